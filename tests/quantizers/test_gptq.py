"""Tests for compress.quantizers.gptq against the slow textbook OBQ reference (tests/references.py).

The reference is float64, column by column, with the full inverse Hessian eliminated after every
column (no Cholesky, no lazy blocks). The library's float32 Cholesky/blocked arithmetic reassociates
sums, so a weight sitting on a rounding tie (x.5 steps) may round the other way; the reference follows
the library at such near-ties (and only there), so both stay on one path and every other code must
agree exactly. Those tie flips are capped at 0.1% of the codes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.quantizers.gptq import GPTQConfig, gptq
from compress.quantizers.grid import QuantScheme, compute_qparams, mse_qparams
from compress.quantizers.result import QuantResult
from compress.quantizers.rtn import rtn

from references import correlated_layer, expand_groups, reference_obq

OUT, IN, TOKENS = 48, 128, 512
TIE_TOL = 1e-3


def proxy_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W − Q) H (W − Q)ᵀ) in float64."""
    d = w.double() - q.double()
    return float(torch.einsum("oi,ij,oj->", d, h.double(), d))


def check_against_reference(res: QuantResult, ref: dict, scheme: QuantScheme) -> None:
    got = res.codes.long()
    mismatch = got != ref["codes"]
    assert not mismatch.any(), f"{int(mismatch.sum())} codes differ away from rounding ties: {mismatch.nonzero()[:5].tolist()}"
    flips = ref["code_flips"]
    if flips.any():  # each flip: a one-step choice at a genuine rounding tie
        r = ref["ratio"][flips]
        assert ((r - r.floor() - 0.5).abs() < TIE_TOL).all()
    # In the symmetric grid the element that sets a group's absmax lands exactly on the tie
    # ±(2**bits − 1)/2 when its group grid is computed from it: counted apart, as in test_rtn.
    endpoint = (ref["ratio"].abs() - scheme.max_code / 2).abs() < TIE_TOL if scheme.symmetric else torch.zeros_like(flips)
    other = int((flips & ~endpoint).sum()) + ref["zero_flips"]
    assert other <= 0.001 * got.numel(), (other, int(flips.sum()), ref["zero_flips"])
    torch.testing.assert_close(res.scale.double(), ref["scale"], rtol=1e-4, atol=0)
    assert torch.equal(res.zero.double(), ref["zero"])
    s_full = torch.from_numpy(expand_groups(ref["scale"].numpy(), got.shape[1]))
    assert ((res.weight.double() - ref["weight"]).abs() <= 1e-4 * s_full * 2**scheme.bits).all()


def run_both(w, h, scheme: QuantScheme, act_order: bool, block_size: int = 32, damp: float = 0.01):
    res = gptq(w, h, GPTQConfig(scheme, block_size=block_size, damp=damp, act_order=act_order, refit_scales=False))
    ref = reference_obq(
        w, h, scheme.bits, scheme.symmetric, scheme.group_size, damp=damp, act_order=act_order,
        follow=(res.codes, res.zero), tie_tol=TIE_TOL,
    )
    return res, ref


CASES = [
    pytest.param(b, sym, gs, ao, id=f"b{b}-{'sym' if sym else 'asym'}-g{gs}-{'act' if ao else 'seq'}")
    for b in (2, 3, 4, 8)
    for sym in (True, False)
    for gs in (-1, 32)
    for ao in (False, True)
]


@pytest.mark.parametrize("bits,sym,gs,act_order", CASES)
def test_matches_slow_reference(bits, sym, gs, act_order):
    w, h, _ = correlated_layer(OUT, IN, TOKENS, seed=bits)
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    res, ref = run_both(w, h, scheme, act_order, block_size=32)

    assert isinstance(res, QuantResult) and res.scheme == scheme
    n_groups = 1 if gs == -1 else IN // gs
    assert res.weight.shape == res.codes.shape == (OUT, IN)
    assert res.scale.shape == res.zero.shape == (OUT, n_groups)
    assert res.weight.dtype == torch.float32 and res.codes.dtype == torch.int32
    assert int(res.codes.min()) >= 0 and int(res.codes.max()) <= scheme.max_code
    check_against_reference(res, ref, scheme)
    if act_order:
        width = IN if gs == -1 else gs
        assert res.g_idx.dtype == torch.int32
        assert torch.equal(res.g_idx, torch.arange(IN, dtype=torch.int32) // width)
    else:
        assert res.g_idx is None
    assert res.stats["damp"] == 0.01 and res.stats["damp_retries"] == 0 and res.stats["dead_columns"] == 0
    assert res.stats["lambda"] == pytest.approx(ref["lam"], rel=1e-5)


@pytest.mark.parametrize("block_size", [1, 17, 48, 128, 500])
@pytest.mark.parametrize("act_order", [False, True])
def test_block_size_only_changes_float_order(block_size, act_order):
    # Blocks that split groups (48 vs 32) and groups that cross block ends: the group grid is
    # always computed from the fully updated columns, so the result follows the textbook order.
    w, h, _ = correlated_layer(OUT, IN, TOKENS, seed=11)
    scheme = QuantScheme(bits=4, symmetric=False, group_size=32)
    res, ref = run_both(w, h, scheme, act_order, block_size=block_size)
    check_against_reference(res, ref, scheme)


@pytest.mark.parametrize("scheme", [
    QuantScheme(bits=3, symmetric=True, group_size=32),
    QuantScheme(bits=3, symmetric=False, group_size=-1),
    QuantScheme(bits=4, symmetric=True, group_size=-1),
], ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_beats_rtn_on_correlated_inputs(scheme, act_order):
    w, h, _ = correlated_layer(64, IN, TOKENS, seed=21)
    res = gptq(w, h, GPTQConfig(scheme, block_size=32, act_order=act_order))
    e_gptq = proxy_error(w, res.weight, h)
    e_rtn = proxy_error(w, rtn(w, scheme).weight, h)
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize("act_order", [False, True])
def test_error_stats_independent(act_order):
    w, h, x = correlated_layer(OUT, IN, TOKENS, seed=31)
    res = gptq(w, h, GPTQConfig(QuantScheme(bits=3, group_size=32), act_order=act_order))
    d = w.double().numpy() - res.weight.double().numpy()
    h64 = h.double().numpy()
    expected = np.trace(d @ h64 @ d.T)
    assert res.stats["error"] == pytest.approx(expected, rel=1e-4)
    # (2/n)‖(W − Q) X‖² for H = 2/n X Xᵀ
    assert res.stats["error"] == pytest.approx(2 / TOKENS * np.sum((d @ x.double().numpy()) ** 2), rel=1e-3)
    w64 = w.double().numpy()
    assert res.stats["rel_error"] == pytest.approx(expected / np.trace(w64 @ h64 @ w64.T), rel=1e-4)
    assert 0 < res.stats["rel_error"] < 0.1


@pytest.mark.parametrize("case", ["dead-inputs", "damp-0.5", "8-bit", "nvfp4"])
@pytest.mark.parametrize("act_order", [False, True])
def test_error_stats_from_the_solve_are_the_proxy_error(case, act_order):
    """The error figure comes from the solve's own scaled errors (``W − Q = E U``, so the damped error is ‖E‖²,
    minus λ‖W − Q‖²): it must equal tr((W − Q) H (W − Q)ᵀ) in float64 where the damping is large, the error tiny
    next to it (8 bits), inputs are dead (their weights are not zero but H's rows are), and on a float grid."""
    from compress.quantizers.float_grid import FloatGrid, FloatScheme

    w, h, x = correlated_layer(OUT, IN, TOKENS, seed=37)
    if case == "dead-inputs":
        w, h, _ = with_dead_inputs(seed=37)
    scheme = {"8-bit": QuantScheme(bits=8, group_size=-1), "nvfp4": FloatScheme(FloatGrid.NVFP4, 16)}.get(case, QuantScheme(bits=3, group_size=32))
    res = gptq(w, h, GPTQConfig(scheme, act_order=act_order, damp=0.5 if case == "damp-0.5" else 0.01))
    assert res.stats["error"] == pytest.approx(proxy_error(w, res.weight, h), rel=1e-5)
    assert res.stats["energy"] == pytest.approx(proxy_error(w, torch.zeros_like(w), h), rel=1e-6)


def with_dead_inputs(seed: int):
    w, h, x = correlated_layer(OUT, IN, TOKENS, seed=seed)
    dead = [0, 5, 33, 64, 127]
    x[dead] = 0.0
    return w, 2.0 / TOKENS * (x @ x.T), dead


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_inputs_not_mutated(act_order, dtype):
    w, h, _ = with_dead_inputs(seed=41)
    w = w.to(dtype)
    w0, h0 = w.clone(), h.clone()
    res = gptq(w, h, GPTQConfig(QuantScheme(bits=4, group_size=32), block_size=32, act_order=act_order, mse=True))
    assert torch.equal(w, w0) and torch.equal(h, h0) and w.dtype == dtype
    assert res.weight.dtype == torch.float32 and res.weight.data_ptr() != w.data_ptr()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_dead_columns(sym, act_order):
    w, h, dead = with_dead_inputs(seed=51)
    scheme = QuantScheme(bits=4, symmetric=sym, group_size=32)
    res, ref = run_both(w, h, scheme, act_order)
    assert torch.isfinite(res.weight).all() and torch.isfinite(res.scale).all()
    assert (res.weight[:, dead] == 0).all()
    assert res.stats["dead_columns"] == len(dead)
    assert np.isfinite(res.stats["error"]) and np.isfinite(res.stats["rel_error"])
    check_against_reference(res, ref, scheme)


def test_all_dead():
    w = correlated_layer(4, 64, 16, seed=0)[0]
    res = gptq(w, torch.zeros(64, 64), GPTQConfig(QuantScheme(bits=4, group_size=32)))
    assert (res.weight == 0).all() and res.stats["dead_columns"] == 64
    assert res.stats["error"] == 0.0 and res.stats["rel_error"] == 0.0


def test_non_finite_inputs_raise():
    w, h, _ = correlated_layer(8, 64, 128, seed=1)
    cfg = GPTQConfig(QuantScheme(bits=4, group_size=32))
    bad_h = h.clone()
    bad_h[3, 7] = float("nan")
    with pytest.raises(ValueError, match="hessian"):
        gptq(w, bad_h, cfg)
    bad_w = w.clone()
    bad_w[2, 2] = float("inf")
    with pytest.raises(ValueError, match="weight"):
        gptq(bad_w, h, cfg)


def indefinite_hessian(seed: int):
    """A Hessian with one eigenvalue at −0.3 · mean(diag H): 1% and 10% damping cannot fix it."""
    w, h, _ = correlated_layer(16, 64, 256, seed=seed)
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(64, generator=g)
    v /= v.norm()
    evals, evecs = torch.linalg.eigh(h.double())
    shift = float(evals[0]) + 0.3 * float(torch.diagonal(h).mean())
    u = evecs[:, 0]
    h = (h.double() - shift * torch.outer(u, u)).float()
    return w, (h + h.T) / 2


def test_damping_escalation():
    w, h = indefinite_hessian(seed=61)
    assert float(torch.linalg.eigvalsh(h.double())[0]) < -0.2 * float(torch.diagonal(h).mean())
    scheme = QuantScheme(bits=4, symmetric=True, group_size=32)
    res = gptq(w, h, GPTQConfig(scheme, block_size=16, refit_scales=False))
    assert res.stats["damp_retries"] > 0 and res.stats["damp"] > 0.01
    assert res.stats["damp"] == pytest.approx(0.01 * 10 ** res.stats["damp_retries"])
    assert res.stats["lambda"] == pytest.approx(res.stats["damp"] * float(torch.diagonal(h).mean()), rel=1e-5)
    assert torch.isfinite(res.weight).all()
    # the textbook reference with the damping finally used agrees
    ref = reference_obq(w, h, 4, True, 32, damp=res.stats["damp"], follow=(res.codes, res.zero), tie_tol=TIE_TOL)
    check_against_reference(res, ref, scheme)


def test_damping_gives_up():
    h = -torch.eye(32)
    with pytest.raises(ValueError, match="positive definite"):
        gptq(torch.ones(4, 32), h, GPTQConfig(QuantScheme(bits=4, group_size=-1), max_damp_tries=2))


def test_singular_hessian_needs_no_escalation():
    w, _, x = correlated_layer(16, 64, 256, seed=71)
    x = x[:, :8]  # rank 8 of 64
    res = gptq(w, 2.0 / 8 * (x @ x.T), GPTQConfig(QuantScheme(bits=4, group_size=32)))
    assert res.stats["damp_retries"] == 0 and torch.isfinite(res.weight).all()


@pytest.mark.parametrize("gs", [-1, 32])
def test_act_order_undoes_permutation(gs):
    # Processing order depends only on diag(H): a column-permuted layer gives the permuted result
    # (per channel exactly; with groups, the static groups follow the columns, so use per-channel).
    w, h, _ = correlated_layer(OUT, IN, TOKENS, seed=81)
    p = torch.randperm(IN, generator=torch.Generator().manual_seed(0))
    scheme = QuantScheme(bits=4, group_size=gs)
    res = gptq(w, h, GPTQConfig(scheme, act_order=True))
    width = IN if gs == -1 else gs
    assert torch.equal(res.g_idx, torch.arange(IN, dtype=torch.int32) // width)
    assert (res.g_idx[1:] >= res.g_idx[:-1]).all()
    if gs == -1:
        assert (res.g_idx == 0).all() and res.scale.shape == (OUT, 1)
        res_p = gptq(w[:, p], h[p][:, p], GPTQConfig(scheme, act_order=True))
        diff = res_p.codes != res.codes[:, p]
        assert int(diff.sum()) <= 0.001 * diff.numel()


@pytest.mark.parametrize("gs", [-1, 32])
def test_mse_grid_in_gptq(gs):
    w, h, _ = correlated_layer(OUT, IN, TOKENS, seed=91)
    scheme = QuantScheme(bits=3, symmetric=False, group_size=gs)
    # static grids (act-order, or per channel): exactly the MSE search on the original weight
    for act_order in ([False, True] if gs == -1 else [True]):
        res = gptq(w, h, GPTQConfig(scheme, act_order=act_order, mse=True, block_size=32, refit_scales=False))
        s, z = mse_qparams(w, scheme)
        assert torch.equal(res.scale, s) and torch.equal(res.zero, z)
        ref = reference_obq(w, h, 3, False, gs, act_order=act_order, params=(s, z),
                            follow=(res.codes, res.zero), tie_tol=TIE_TOL)
        check_against_reference(res, ref, scheme)
        assert not torch.equal(s, compute_qparams(w, scheme)[0])  # the search did clip something
    # dynamic groups: grids differ from min-max, and the result is still a sane GPTQ result
    res = gptq(w, h, GPTQConfig(scheme, mse=True, block_size=32))
    base = gptq(w, h, GPTQConfig(scheme, block_size=32))
    assert torch.isfinite(res.weight).all()
    assert res.stats["error"] < 1.5 * base.stats["error"]


def test_config_and_shape_validation():
    scheme = QuantScheme(bits=4, group_size=32)
    for bad in (dict(block_size=0), dict(damp=0.0), dict(mse_grid=0), dict(mse_max_shrink=0.0), dict(max_damp_tries=-1)):
        with pytest.raises(ValueError):
            GPTQConfig(scheme, **bad)
    w, h, _ = correlated_layer(4, 64, 64, seed=0)
    with pytest.raises(ValueError):
        gptq(w, h[:32, :32], GPTQConfig(scheme))
    with pytest.raises(ValueError):
        gptq(w[:, :48], h[:48, :48], GPTQConfig(scheme))  # 32 does not divide 48


def test_small_layer_and_bf16_weight():
    w, h, _ = correlated_layer(1, 8, 32, seed=2)
    res = gptq(w.bfloat16(), h, GPTQConfig(QuantScheme(bits=2, symmetric=False, group_size=4), block_size=3, refit_scales=False))
    assert res.weight.shape == (1, 8) and torch.isfinite(res.weight).all()
    ref = reference_obq(w.bfloat16(), h, 2, False, 4, follow=(res.codes, res.zero), tie_tol=TIE_TOL)
    check_against_reference(res, ref, QuantScheme(bits=2, symmetric=False, group_size=4))


def test_method_names_the_layer_when_statistics_are_broken():
    from compress.errors import CompressError
    from compress.engine.methods.gptq import GPTQ
    from compress.engine.statistics import Stat

    method = GPTQ(GPTQ.Config(bits=4, group_size=-1))
    hessian = torch.eye(8)
    hessian[3, 3] = float("nan")
    with pytest.raises(CompressError, match=r"GPTQ failed on model\.layers\.7\.mlp\.up_proj: hessian contains NaN"):
        method.transform_layer("model.layers.7.mlp.up_proj", torch.randn(4, 8), {Stat.HESSIAN: hessian})


@pytest.mark.parametrize("width", [7, 1024, 1025, 3000])
def test_proxy_loss_rows_reads_half_of_h_and_is_the_full_quadratic_form(width):
    """``tr(Δ H Δᵀ)`` by row from H's blocks on and above the diagonal only (several blocks and a ragged last one
    from 1025 columns on) equals the float64 quadratic form of the whole H; a strided Δ (a column slice) too."""
    from compress.quantizers.gptq import proxy_loss_rows

    g = torch.Generator().manual_seed(width)
    x = torch.randn(width + 64, width, generator=g) + 0.3 * torch.randn(1, width, generator=g)
    h = x.t() @ x / x.shape[0]
    h = (h + h.t()) / 2  # exactly symmetric, as the engine's Hessians are
    wide = torch.randn(24, width + 5, generator=g)
    delta = wide[:, 5:]  # rows strided by width + 5
    expected = torch.einsum("oi,ij,oj->o", delta.double(), h.double(), delta.double())
    got = proxy_loss_rows(delta, h)
    assert got.dtype == torch.float64 and got.shape == (24,)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)


@pytest.mark.parametrize("n,rows", [(1, 256), (7, 3), (300, 256), (513, 64)])
def test_permuted_square_gathers_rows_and_columns(n, rows):
    """``H[perm][:, perm]`` by strips: the very entries of numpy's fancy indexing, whatever the strip height."""
    from compress.quantizers.gptq import permuted_square

    H = torch.randn(n, n, generator=torch.Generator().manual_seed(n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n + 1))
    expected = torch.from_numpy(H.numpy()[np.ix_(perm.numpy(), perm.numpy())])
    assert torch.equal(permuted_square(H, perm, rows), expected)


@pytest.mark.parametrize("act_order", [False, True])
def test_full_range_grid_with_uncorrelated_inputs_is_rtn(act_order):
    """A diagonal Hessian feeds no error to other columns, so GPTQ rounds each weight to nearest on the grid it
    fits: RTN's (tested against a float64 loop in test_grid), with its signed full-range scales."""
    w, _, _ = correlated_layer(OUT, IN, TOKENS, seed=5)
    h = torch.diag(torch.rand(IN, generator=torch.Generator().manual_seed(1)) + 0.5)
    scheme = QuantScheme(3, True, 32, full_range=True)
    res, want = gptq(w, h, GPTQConfig(scheme, block_size=32, act_order=act_order, refit_scales=False)), rtn(w, scheme)
    assert (res.scale < 0).any() and (res.scale > 0).any()
    assert torch.equal(res.codes, want.codes) and torch.equal(res.scale, want.scale)
    torch.testing.assert_close(res.weight, want.weight, rtol=0, atol=0)


@pytest.mark.parametrize("scheme", [QuantScheme(3, True, 32), QuantScheme(2, False, 32), QuantScheme(4, True, -1),
                                    QuantScheme(3, True, 32, full_range=True)], ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_refit_scales_reach_each_rows_least_squares_optimum(scheme, act_order):
    """After the loop each group's scale is solved on the whole H (`refit_scales`, the default): the codes and zero
    points are the loop's, every row's loss is at most the unrefitted one's and at a dense float64 solve's optimum
    over the groups' scale factors (but for float32 rounding), and the figures are those of the written weight."""
    w, h, _ = correlated_layer(12, 128, 512, seed=7)
    plain = gptq(w, h, GPTQConfig(scheme, block_size=32, act_order=act_order, refit_scales=False))
    res = gptq(w, h, GPTQConfig(scheme, block_size=32, act_order=act_order))
    assert torch.equal(res.codes, plain.codes) and torch.equal(res.zero, plain.zero)
    torch.testing.assert_close(res.weight, scheme.dequantize(res.codes, res.scale, res.zero), rtol=0, atol=0)
    H = h.double()
    width = scheme.group_width(128)

    def losses(q):
        e = w.double() - q.double()
        return ((e @ H) * e).sum(1)

    before, after = losses(plain.weight), losses(res.weight)
    best = torch.empty(12, dtype=torch.float64)
    for r in range(12):  # the dense solve: one column of Z per group, the row's decode on that group
        Z = torch.zeros(128, 128 // width, dtype=torch.float64)
        for g in range(128 // width):
            Z[g * width : (g + 1) * width, g] = plain.weight[r, g * width : (g + 1) * width].double()
        e = w[r].double() - plain.weight[r].double()
        delta = torch.linalg.lstsq(Z.T @ H @ Z, Z.T @ H @ e).solution
        best[r] = (e - Z @ delta) @ H @ (e - Z @ delta)
    assert (after <= before * (1 + 1e-6)).all() and after.sum() < 0.995 * before.sum()
    assert (after - best <= 1e-5 * before).all() and (after >= best - 1e-6 * before).all(), (after - best) / before
    assert res.stats["error"] == pytest.approx(float(after.sum()), rel=1e-4)
