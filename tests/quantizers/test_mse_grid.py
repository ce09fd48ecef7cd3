"""Tests for compress.quantizers.grid.mse_qparams: the clipping search of GPTQ's reference find_params(mse=True)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.quantizers import clipping
from compress.quantizers.grid import QuantScheme, compute_qparams, dequantize, mse_qparams, quantize
from compress.quantizers.native import compiled

from references import expand_groups


def heavy_tailed(shape, seed: int) -> torch.Tensor:
    """Gaussian weights with a few large outliers per row: clipping the range pays off."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w *= torch.exp(torch.randn(shape, generator=g) * 0.7)
    return w


def independent_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, norm: float) -> np.ndarray:
    """sum |w - deq|**norm per (row, group) in float64 numpy, not using the library grid."""
    w64 = w.double().numpy()
    cols = w64.shape[1]
    s = expand_groups(scale.double().numpy(), cols)
    z = expand_groups(zero.double().numpy(), cols)
    q = np.clip(np.rint(w64 / s) + z, 0, 2**bits - 1)
    e = np.abs(w64 - s * (q - z)) ** norm
    return e.reshape(w64.shape[0], scale.shape[1], -1).sum(-1)


CASES = [
    pytest.param(b, sym, gs, id=f"b{b}-{'sym' if sym else 'asym'}-g{gs}")
    for b in (2, 3, 4, 8)
    for sym in (True, False)
    for gs in (-1, 32)
]


@pytest.mark.parametrize("bits,sym,gs", CASES)
def test_never_worse_than_min_max(bits, sym, gs, search):
    w = heavy_tailed((12, 128), seed=bits * 10 + gs % 7)
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    scale, zero = mse_qparams(w, scheme)
    n_groups = 1 if gs == -1 else 128 // gs
    assert scale.shape == zero.shape == (12, n_groups)
    assert scale.dtype == zero.dtype == torch.float32
    assert (scale > 0).all() and torch.isfinite(zero).all()
    s1, z1 = compute_qparams(w, scheme)
    e_mse = independent_error(w, scale, zero, bits, 2.4)
    e_one = independent_error(w, s1, z1, bits, 2.4)
    assert (e_mse <= e_one * (1 + 1e-5)).all()
    # and the clipped range never exceeds the min-max one
    assert (scale <= s1 * (1 + 1e-6)).all()
    if bits <= 4:  # on heavy-tailed weights clipping pays off somewhere
        assert (scale < s1 * 0.999).any()
        assert e_mse.sum() < e_one.sum()


@pytest.fixture(params=["compiled", "torch"])
def search(request, monkeypatch):
    """The search compiled (`compress.quantizers.clipping`, where a C compiler builds it) and in torch."""
    if request.param == "torch":
        monkeypatch.setenv("COMPRESS_NATIVE", "0")
    elif compiled(clipping.SOURCE, clipping.SIGNATURES, clipping.EXTRA_FLAGS) is None:
        pytest.skip("no C compiler builds the compiled search here")
    return request.param


@pytest.mark.parametrize("grid,max_shrink,norm", [(100, 0.8, 2.4), (20, 0.5, 2.0), (7, 1.0, 3.0), (10, 0.1, 2.4)])
@pytest.mark.parametrize("bits,sym,gs", [(3, True, 32), (4, False, 32), (2, False, -1), (4, True, -1), (2, "full", 32)])
def test_equals_brute_force(grid, max_shrink, norm, bits, sym, gs, search):
    """Every candidate's error in float64 numpy: the search keeps the first minimum. The search takes
    ``|e|**norm`` in float32 (torch: ``exp(norm log|e|)``; compiled: polynomials within 1e-6), so where two
    candidates' errors lie within float32 noise of each other (1e-5 relative) either may win; everywhere else the
    choice is the brute force's."""
    w = heavy_tailed((10, 96), seed=grid + bits)
    scheme = QuantScheme(bits=bits, symmetric=bool(sym), group_size=gs, full_range=sym == "full")  # full: signed scales
    shrinks = [1 - i / grid for i in range(int(max_shrink * grid))]
    cands = [compute_qparams(w, scheme, shrink=p) for p in shrinks]
    errs = np.stack([independent_error(w, s, z, bits, norm) for s, z in cands])  # [candidates, rows, groups]
    best = np.argmin(errs, axis=0)  # first minimum: ties keep the larger shrink factor
    exp_s = np.take_along_axis(np.stack([c[0].numpy() for c in cands]), best[None], 0)[0]
    exp_z = np.take_along_axis(np.stack([c[1].numpy() for c in cands]), best[None], 0)[0]

    scale, zero = mse_qparams(w, scheme, grid=grid, max_shrink=max_shrink, norm=norm)
    minimum = errs.min(axis=0)
    runner_up = np.where(errs > minimum * (1 + 1e-12), errs, np.inf).min(axis=0)
    clear = runner_up > minimum * (1 + 1e-5)
    assert clear.mean() > 0.9  # the cases are not all near-ties
    np.testing.assert_array_equal(scale.numpy()[clear], exp_s[clear])
    np.testing.assert_array_equal(zero.numpy()[clear], exp_z[clear])
    chosen = independent_error(w, scale, zero, bits, norm)
    assert (chosen <= minimum * (1 + 1e-5)).all()


def test_single_candidate_is_min_max():
    w = heavy_tailed((4, 64), seed=3)
    scheme = QuantScheme(bits=4, symmetric=False, group_size=32)
    s, z = mse_qparams(w, scheme, grid=10, max_shrink=0.1)  # only p = 1
    s1, z1 = compute_qparams(w, scheme)
    assert torch.equal(s, s1) and torch.equal(z, z1)


@pytest.mark.parametrize("sym", [True, False])
def test_zero_and_half_precision_inputs(sym):
    scheme = QuantScheme(bits=4, symmetric=sym, group_size=32)
    w = heavy_tailed((4, 64), seed=5)
    w[1] = 0.0
    s, z = mse_qparams(w.half(), scheme)
    assert torch.isfinite(s).all() and (s > 0).all()
    deq = dequantize(quantize(w, s, z, scheme), s, z, scheme)
    assert (deq[1] == 0).all()


def test_rejects_non_dividing_group():
    with pytest.raises(ValueError):
        mse_qparams(heavy_tailed((2, 100), seed=0), QuantScheme(bits=4, group_size=32))


def test_compiled_and_torch_searches_choose_alike_but_for_near_ties(monkeypatch):
    """A layer's worth of heavy-tailed groups: the two searches' rounding errors are the same bits, their powers within
    1e-6, so they choose differently only where two candidates' sums are that close (here under 1 in 1000 groups)."""
    if compiled(clipping.SOURCE, clipping.SIGNATURES, clipping.EXTRA_FLAGS) is None:
        pytest.skip("no C compiler builds the compiled search here")
    w = heavy_tailed((256, 512), seed=11)
    for sym in (True, False):
        scheme = QuantScheme(bits=3, symmetric=sym, group_size=64)
        fast = mse_qparams(w, scheme)
        monkeypatch.setenv("COMPRESS_NATIVE", "0")
        slow = mse_qparams(w, scheme)
        monkeypatch.delenv("COMPRESS_NATIVE")
        differ = fast[0] != slow[0]
        assert differ.float().mean() < 1e-3
        e_fast = independent_error(w, *fast, 3, 2.4)[differ.numpy()]
        e_slow = independent_error(w, *slow, 3, 2.4)[differ.numpy()]
        np.testing.assert_allclose(e_fast, e_slow, rtol=1e-5)


@pytest.mark.parametrize("bits,sym", [(2, True), (3, False), (4, True), (4, False), (4, "full"), (8, False)])
@pytest.mark.parametrize("grid,max_shrink", [(100, 0.8), (40, 1.0), (20, 0.8), (100, 0.17)])
def test_compiled_search_drops_only_candidates_that_cannot_win(bits, sym, grid, max_shrink):
    """The compiled search sums a later candidate in full only where its errors on a group's largest weights do not
    already exceed the best sum so far: its choice is the exhaustive search's, bit for bit, on groups of every width
    (4: no weights left to bound with), with outliers, ties (constant and all-zero groups: every candidate alike) and
    candidate counts on either side of the 16 always summed."""
    if compiled(clipping.SOURCE, clipping.SIGNATURES, clipping.EXTRA_FLAGS) is None:
        pytest.skip("no C compiler builds the compiled search here")
    shrinks = [1 - i / grid for i in range(int(max_shrink * grid))]
    later_wins = 0  # groups whose choice is a candidate after the first 16
    for gs, seed in ((4, 1), (8, 2), (32, 3), (64, 4), (128, 5)):
        w = heavy_tailed((96, 256), seed=seed + bits * 10)
        w[:, : 2 * gs] *= torch.exp(torch.randn(96, 1, generator=torch.Generator().manual_seed(seed)) * 2)  # wide rows
        w[48:, ::gs] *= 6  # a lone outlier in each group: a clipped range pays off most
        w[0] = 0.0
        w[1] = 0.01
        w[2, ::3] = -0.02
        scheme = QuantScheme(bits=bits, symmetric=bool(sym), group_size=gs, full_range=sym == "full")
        extremes = scheme.extremes(w)
        fast = clipping.compiled_search(w, scheme, shrinks, 2.4, extremes)
        slow = clipping.compiled_search(w, scheme, shrinks, 2.4, extremes, exhaustive=True)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
        if len(shrinks) > 16:
            later_wins += int((slow[0].abs() < scheme.qparams(w, shrink=shrinks[15], extremes=extremes)[0].abs()).sum())
    if (grid, max_shrink) == (100, 0.8) and (bits <= 3 or sym is True):  # later candidates win in some groups (4-bit
        # asymmetric and full-range grids keep shrink >= 0.9 on these weights): dropping them is tested
        assert later_wins > 0


@pytest.mark.parametrize("bits,sym", [(2, False), (4, True), (4, False), (3, "full"), (8, True)])
def test_candidates_broadcast_over_shrink_factors_equal_one_call_each(bits, sym):
    """The compiled search takes every candidate's scale and zero in one `qparams` call, the shrink factors a float32
    tensor broadcast over a last axis of the extremes: the very values of one call per factor (a Python float, which
    torch multiplies as float32), all-zero and one-signed groups included."""
    w = heavy_tailed((16, 128), seed=bits)
    w[0] = 0.0
    w[1] = w[1].abs()
    w[2] = -w[2].abs()
    scheme = QuantScheme(bits=bits, symmetric=bool(sym), group_size=32, full_range=sym == "full")
    low, high = scheme.extremes(w)
    shrinks = [1 - i / 100 for i in range(80)]
    scales, zeros = scheme.qparams(w, shrink=torch.tensor(shrinks), extremes=(low.unsqueeze(-1), high.unsqueeze(-1)))
    for i, p in enumerate(shrinks):
        s, z = scheme.qparams(w, shrink=p, extremes=(low, high))
        assert torch.equal(scales[..., i], s) and torch.equal(zeros[..., i], z)
