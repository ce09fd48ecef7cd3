"""Tests for compress.quantizers.rtn against an independent float64 min-max reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.quantizers.grid import QuantScheme
from compress.quantizers.result import QuantResult
from compress.quantizers.rtn import rtn

BITS = list(range(2, 9))
GROUP_SIZES = [-1, 32, 128]
SHAPES = [(8, 256), (5, 128), (3, 64)]
CASES = [
    pytest.param(b, sym, gs, shape, id=f"b{b}-{'sym' if sym else 'asym'}-g{gs}-{shape[0]}x{shape[1]}")
    for b in BITS
    for sym in (True, False)
    for gs in GROUP_SIZES
    for shape in SHAPES
    if gs == -1 or shape[1] % gs == 0
]

# Independent float64 reference (a copy of the one in test_grid.py: test modules are imported in
# importlib mode and cannot import each other).


def _weight(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def reference_grid(w: np.ndarray, bits: int, symmetric: bool, group_size: int):
    """Textbook min-max grid in float64. Returns codes, scale, zero, dequant, and the unrounded w/s."""
    w = np.asarray(w, dtype=np.float64)
    rows, cols = w.shape
    width = cols if group_size == -1 else group_size
    n_groups = cols // width
    max_code = 2**bits - 1
    codes = np.zeros((rows, cols), dtype=np.int64)
    ratio = np.zeros((rows, cols), dtype=np.float64)
    deq = np.zeros((rows, cols), dtype=np.float64)
    scale = np.zeros((rows, n_groups), dtype=np.float64)
    zero = np.zeros((rows, n_groups), dtype=np.float64)
    for r in range(rows):
        for g in range(n_groups):
            seg = w[r, g * width : (g + 1) * width]
            if symmetric:
                s = float(np.max(np.abs(seg))) / (max_code / 2.0)
                z = float(2 ** (bits - 1))
            else:
                lo = min(float(np.min(seg)), 0.0)
                hi = max(float(np.max(seg)), 0.0)
                s = (hi - lo) / max_code
                z = float(min(max(np.rint(-lo / s), 0), max_code)) if s > 0 else 0.0
            if s == 0:
                s = 1.0
            scale[r, g] = s
            zero[r, g] = z
            for c in range(width):
                t = seg[c] / s
                q = int(min(max(np.rint(t) + z, 0), max_code))
                codes[r, g * width + c] = q
                ratio[r, g * width + c] = t
                deq[r, g * width + c] = s * (q - z)
    return codes, scale, zero, deq, ratio


def _expand_np(p: np.ndarray, cols: int) -> np.ndarray:
    return np.repeat(p, cols // p.shape[1], axis=1)


def assert_codes_match(got: np.ndarray, ref: np.ndarray, ratio: np.ndarray, symmetric: bool, bits: int):
    """Codes equal the reference except off-by-one at (near) exact .5 rounding ties.

    In the symmetric grid the group's absmax element sits exactly on the tie ±(2**bits - 1)/2 by
    construction; float32 may land it on either side. Those are counted separately; every other
    tie-induced mismatch must stay below 0.1% of the codes (plus one).
    """
    diff = got.astype(np.int64) - ref
    bad = diff != 0
    if not bad.any():
        return
    assert np.abs(diff[bad]).max() == 1, "codes differ by more than one step"
    frac = np.abs(ratio - np.floor(ratio) - 0.5)
    near_tie = frac < 1e-4
    assert near_tie[bad].all(), f"mismatching codes away from a rounding tie: {np.argwhere(bad & ~near_tie)[:5]}"
    endpoint = np.isclose(np.abs(ratio), (2**bits - 1) / 2, rtol=0, atol=1e-4) if symmetric else np.zeros_like(bad)
    other = (bad & ~endpoint).sum()
    assert other <= 1 + 0.001 * got.size, f"{other} tie mismatches out of {got.size}"


@pytest.mark.parametrize("bits,sym,gs,shape", CASES)
def test_rtn_matches_reference(bits, sym, gs, shape):
    w = _weight(shape, seed=1000 + bits * 7 + shape[1]) * 0.05
    original = w.clone()
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    res = rtn(w, scheme)

    assert isinstance(res, QuantResult)
    assert torch.equal(w, original), "rtn mutated its input"
    n_groups = 1 if gs == -1 else shape[1] // gs
    assert res.weight.shape == shape and res.codes.shape == shape
    assert res.scale.shape == (shape[0], n_groups) and res.zero.shape == (shape[0], n_groups)
    assert res.weight.dtype == torch.float32
    assert res.codes.dtype == torch.int32
    assert res.scheme == scheme
    assert res.g_idx is None
    assert res.weight is not w

    ref_q, ref_s, ref_z, ref_deq, ratio = reference_grid(w.numpy(), bits, sym, gs)
    np.testing.assert_allclose(res.scale.numpy(), ref_s, rtol=1e-6)
    np.testing.assert_array_equal(res.zero.numpy(), ref_z)
    assert_codes_match(res.codes.numpy(), ref_q, ratio, sym, bits)
    s_full = _expand_np(ref_s, shape[1])
    d = np.abs(res.weight.numpy().astype(np.float64) - ref_deq)
    same = res.codes.numpy() == ref_q
    assert (d[same] <= 1e-5 * s_full[same] * 2**bits + 1e-9).all()
    assert (d[~same] <= s_full[~same] * (1 + 1e-5)).all()

    # ||W - Q|| / ||W|| from the independent reference (ties move a weight by exactly the same
    # half step either way, so the figure is unaffected by them)
    w64 = w.numpy().astype(np.float64)
    expected = np.linalg.norm(w64 - ref_deq) / np.linalg.norm(w64)
    assert res.stats["weight_rel_error"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gs", [-1, 32])
def test_rtn_half_precision_inputs(dtype, sym, gs):
    w = (_weight((5, 128), seed=31) * 0.02).to(dtype)
    original = w.clone()
    scheme = QuantScheme(bits=4, symmetric=sym, group_size=gs)
    res = rtn(w, scheme)
    assert torch.equal(w, original) and w.dtype == dtype
    assert res.weight.dtype == torch.float32
    assert res.codes.dtype == torch.int32
    w64 = w.float().numpy().astype(np.float64)
    ref_q, ref_s, ref_z, ref_deq, ratio = reference_grid(w64, 4, sym, gs)
    np.testing.assert_allclose(res.scale.numpy(), ref_s, rtol=1e-6)
    assert_codes_match(res.codes.numpy(), ref_q, ratio, sym, 4)
    s_full = _expand_np(ref_s, 128)
    assert (np.abs(res.weight.numpy() - ref_deq) <= s_full * (1 + 1e-5)).all()
    expected = np.linalg.norm(w64 - ref_deq) / np.linalg.norm(w64)
    assert res.stats["weight_rel_error"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_zero_weight(sym):
    w = torch.zeros(3, 64)
    res = rtn(w, QuantScheme(bits=4, symmetric=sym, group_size=32))
    assert (res.weight == 0).all()
    assert (res.scale > 0).all()
    assert res.stats["weight_rel_error"] == 0.0


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_error_decreases_with_bits(sym):
    w = _weight((8, 256), seed=41)
    errs = [rtn(w, QuantScheme(bits=b, symmetric=sym, group_size=128)).stats["weight_rel_error"] for b in BITS]
    assert all(b <= a for a, b in zip(errs, errs[1:])), errs
    assert 0 < errs[-1] < 0.01 < errs[0] < 1


def test_rtn_rejects_non_dividing_group():
    with pytest.raises(ValueError):
        rtn(_weight((2, 100), seed=0), QuantScheme(bits=4, group_size=32))
