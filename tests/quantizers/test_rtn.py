"""Tests for compress.quantizers.rtn against an independent float64 min-max reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.quantizers.grid import QuantScheme
from compress.quantizers.result import QuantResult
from compress.quantizers.rtn import _library, rtn

from references import assert_codes_match, expand_groups, random_weight, reference_grid

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

def code_dtype(w: torch.Tensor, scheme: QuantScheme) -> torch.dtype:
    """The compiled loop writes codes as bytes, the torch loop as int32."""
    return torch.uint8 if _library(w, scheme) is not None else torch.int32


@pytest.mark.parametrize("bits,sym,gs,shape", CASES)
def test_rtn_matches_reference(bits, sym, gs, shape):
    w = random_weight(shape, seed=1000 + bits * 7 + shape[1]) * 0.05
    original = w.clone()
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    res = rtn(w, scheme)

    assert isinstance(res, QuantResult)
    assert torch.equal(w, original), "rtn mutated its input"
    n_groups = 1 if gs == -1 else shape[1] // gs
    assert res.weight.shape == shape and res.codes.shape == shape
    assert res.scale.shape == (shape[0], n_groups) and res.zero.shape == (shape[0], n_groups)
    assert res.weight.dtype == torch.float32
    assert res.codes.dtype == code_dtype(w, scheme)
    assert res.scheme == scheme
    assert res.g_idx is None
    assert res.weight is not w

    ref_q, ref_s, ref_z, ref_deq, ratio = reference_grid(w.numpy(), bits, sym, gs)
    np.testing.assert_allclose(res.scale.numpy(), ref_s, rtol=1e-6)
    np.testing.assert_array_equal(res.zero.numpy(), ref_z)
    assert_codes_match(res.codes.numpy(), ref_q, ratio, sym, bits)
    s_full = expand_groups(ref_s, shape[1])
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
    w = (random_weight((5, 128), seed=31) * 0.02).to(dtype)
    original = w.clone()
    scheme = QuantScheme(bits=4, symmetric=sym, group_size=gs)
    res = rtn(w, scheme)
    assert torch.equal(w, original) and w.dtype == dtype
    # compiled (bfloat16): values in the weight's dtype, byte codes; else float32 values, int32 codes
    assert res.weight.dtype == (dtype if _library(w, scheme) is not None else torch.float32)
    assert res.codes.dtype == code_dtype(w, scheme)
    w64 = w.float().numpy().astype(np.float64)
    ref_q, ref_s, ref_z, ref_deq, ratio = reference_grid(w64, 4, sym, gs)
    np.testing.assert_allclose(res.scale.numpy(), ref_s, rtol=1e-6)
    assert_codes_match(res.codes.numpy(), ref_q, ratio, sym, 4)
    s_full = expand_groups(ref_s, 128)
    rounding = np.abs(ref_deq) * 2.0**-8 if res.weight.dtype == torch.bfloat16 else 0.0  # at least half a bfloat16 ulp
    assert (np.abs(res.weight.float().numpy() - ref_deq) <= s_full * (1 + 1e-5) + rounding).all()
    expected = np.linalg.norm(w64 - ref_deq) / np.linalg.norm(w64)
    assert res.stats["weight_rel_error"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_zerorandom_weight(sym):
    w = torch.zeros(3, 64)
    res = rtn(w, QuantScheme(bits=4, symmetric=sym, group_size=32))
    assert (res.weight == 0).all()
    assert (res.scale > 0).all()
    assert res.stats["weight_rel_error"] == 0.0


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_error_decreases_with_bits(sym):
    w = random_weight((8, 256), seed=41)
    errs = [rtn(w, QuantScheme(bits=b, symmetric=sym, group_size=128)).stats["weight_rel_error"] for b in BITS]
    assert all(b <= a for a, b in zip(errs, errs[1:])), errs
    assert 0 < errs[-1] < 0.01 < errs[0] < 1


def test_rtn_rejects_non_dividing_group():
    with pytest.raises(ValueError):
        rtn(random_weight((2, 100), seed=0), QuantScheme(bits=4, group_size=32))


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_in_row_slices_matches_reference(sym, monkeypatch):
    """Large layers are rounded a few rows at a time (`SLICE_ELEMENTS`): 7 rows in slices of 2 give the
    reference's grid and codes and the whole weight's error figure."""
    from compress.quantizers import rtn as rtn_module

    monkeypatch.setenv("COMPRESS_NATIVE", "0")  # the torch loop, which slices (the compiled one runs whole)
    monkeypatch.setattr(rtn_module, "SLICE_ELEMENTS", 2 * 128)
    w = random_weight((7, 128), seed=77) * 0.05
    res = rtn(w, QuantScheme(bits=3, symmetric=sym, group_size=32))
    ref_q, ref_s, ref_z, ref_deq, ratio = reference_grid(w.numpy(), 3, sym, 32)
    np.testing.assert_allclose(res.scale.numpy(), ref_s, rtol=1e-6)
    np.testing.assert_array_equal(res.zero.numpy(), ref_z)
    assert_codes_match(res.codes.numpy(), ref_q, ratio, sym, 3)
    w64 = w.numpy().astype(np.float64)
    expected = np.linalg.norm(w64 - ref_deq) / np.linalg.norm(w64)
    assert res.stats["weight_rel_error"] == pytest.approx(expected, rel=1e-4)


def test_rtn_in_row_slices_keeps_per_tensor_scales_and_per_group_clipping(monkeypatch):
    """NVFP4's global scale comes from the whole weight (compressed-tensors' fake quantization with it),
    and a per-group shrink is sliced with its rows."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    from compress.quantizers import rtn as rtn_module
    from compress.quantizers.float_grid import FloatGrid, FloatScheme

    monkeypatch.setenv("COMPRESS_NATIVE", "0")  # the torch loop, which slices
    monkeypatch.setattr(rtn_module, "SLICE_ELEMENTS", 3 * 64)
    w = random_weight((8, 64), seed=78) * 0.05
    w[6, 3] = 0.8  # the largest weight, in the last slice: the global scale must see it
    res = rtn(w, FloatScheme(FloatGrid.NVFP4, 16))
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                            scale_dtype=torch.float8_e4m3fn)
    expected = fake_quantize(w, res.scale, None, args, global_scale=generate_gparam(w.min(), w.max()))
    assert res.scheme.global_scale == float(generate_gparam(w.min(), w.max()))
    assert torch.equal(res.weight, expected)

    shrink = torch.linspace(0.6, 1.0, 8 * 4).reshape(8, 4)
    scheme = QuantScheme(bits=4, symmetric=True, group_size=16)
    clipped = rtn(w, scheme, shrink)
    absmax = w.reshape(8, 4, 16).abs().amax(-1) * shrink
    np.testing.assert_allclose(clipped.scale.numpy(), (absmax / 7.5).numpy(), rtol=1e-6)


def test_rtn_of_a_weight_without_rows():
    res = rtn(torch.zeros(0, 64), QuantScheme(bits=4, group_size=32))
    assert res.weight.shape == res.codes.shape == (0, 64) and res.scale.shape == (0, 2)
    assert res.stats["weight_rel_error"] == 0.0


COMPILED_CASES = [(4, True, 64, False), (3, True, 32, True), (2, True, -1, True), (8, True, 64, False), (4, False, 64, False),
                  (2, False, 32, False), (5, False, -1, False)]


@pytest.mark.parametrize("bits, sym, gs, full_range", COMPILED_CASES,
                         ids=[f"b{b}-{'sym' if s else 'asym'}-g{g}{'-full' if f else ''}" for b, s, g, f in COMPILED_CASES])
def test_the_compiled_loop_gives_the_torch_loops_bits(bits, sym, gs, full_range, monkeypatch):
    """The compiled RTN (csrc/rtn.c, on the CPU's threads) against the torch loop: the same scale, zero, codes and values
    bit for bit, with a per-group shrink too; weights on exact half steps (ties, rounded to even by both), an all-zero
    group and a row of one value; the error figure as float64 sums give it."""
    from compress.quantizers import native

    if native.compiled(__import__("compress.quantizers.rtn", fromlist=["SOURCE"]).SOURCE, ()) is None:
        pytest.skip("no C compiler: the torch loop runs everywhere")
    torch.manual_seed(bits)
    w = torch.randn(300, 256) * 0.05
    w[3, :64] = 0.0
    w[4] = 0.25
    w[5, :64] = torch.arange(64) / 4 - 8  # multiples of 1/4: half steps of many grids
    w = w.to(torch.bfloat16).float()  # short mantissas: more exact ties
    scheme = QuantScheme(bits, sym, gs, full_range)
    groups = 1 if gs == -1 else 256 // gs
    for shrink in (1.0, torch.linspace(0.7, 1.0, 300 * groups).reshape(300, groups)):
        torch.set_num_threads(2)
        try:
            ours = rtn(w, scheme, shrink)
        finally:
            torch.set_num_threads(1)
        monkeypatch.setenv("COMPRESS_NATIVE", "0")
        theirs = rtn(w, scheme, shrink)
        monkeypatch.delenv("COMPRESS_NATIVE")
        assert ours.codes.dtype == torch.uint8 and theirs.codes.dtype == torch.int32
        for field in ("weight", "codes", "scale", "zero"):
            a, b = getattr(ours, field), getattr(theirs, field)
            assert torch.equal(a, b.to(a.dtype)), field
        w64 = w.double()
        exact = float((w64 - ours.weight.double()).norm() / w64.norm())
        assert ours.stats["weight_rel_error"] == pytest.approx(exact, rel=1e-9)  # summed in float64
        assert theirs.stats["weight_rel_error"] == pytest.approx(exact, rel=1e-4)  # torch's float32 norms


@pytest.mark.parametrize("bits, sym, gs, full_range", COMPILED_CASES[:4],
                         ids=[f"b{b}-{'sym' if s else 'asym'}-g{g}{'-full' if f else ''}" for b, s, g, f in COMPILED_CASES[:4]])
def test_a_bfloat16_weight_gives_what_its_float32_copy_gives(bits, sym, gs, full_range):
    """`rtn` of a bfloat16 weight (widened inside the compiled loop, with no float32 copy) equals `rtn` of its float32
    copy bit for bit: scale, zero, codes, values and the error figure; its input is left as it was."""
    torch.manual_seed(bits + 10)
    w = (torch.randn(300, 256) * 0.05).to(torch.bfloat16)
    w[7, :32] = 0
    original = w.clone()
    from compress.quantizers import rtn as rtn_module

    if rtn_module._library(w.float(), QuantScheme(bits, sym, gs, full_range)) is not None:  # a C compiler: both compiled
        assert rtn_module._library(w, QuantScheme(bits, sym, gs, full_range)) is not None
    ours, theirs = rtn(w, QuantScheme(bits, sym, gs, full_range)), rtn(w.float(), QuantScheme(bits, sym, gs, full_range))
    assert torch.equal(w.view(torch.int16), original.view(torch.int16))
    assert ours.weight.dtype == torch.bfloat16  # the float32 copy's values rounded: what a bfloat16 block holds
    for field in ("weight", "codes", "scale", "zero"):
        a, b = getattr(ours, field), getattr(theirs, field)
        assert torch.equal(a, b.to(a.dtype)), field
    assert ours.stats["weight_rel_error"] == theirs.stats["weight_rel_error"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_overwrite_writes_the_values_over_the_weight(dtype, layout):
    """``overwrite=True``: the same codes, grid and error figure as a fresh result, the values (in the weight's
    dtype) written over the weight itself, which the result holds; a transposed view (GPT-2's Conv1D) included."""
    torch.manual_seed(5)
    base = (torch.randn(96, 128) * 0.05).to(dtype)
    weight = base.clone() if layout == "rows" else base.t().contiguous().t()
    scheme = QuantScheme(4, False, 32)
    fresh = rtn(weight.clone(), scheme)
    result = rtn(weight, scheme, overwrite=True)
    assert result.weight is weight and weight.dtype == dtype
    assert torch.equal(weight, fresh.weight.to(dtype))
    for field in ("codes", "scale", "zero"):
        assert torch.equal(getattr(result, field), getattr(fresh, field)), field
    assert result.stats == fresh.stats
