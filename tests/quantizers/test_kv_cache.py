"""KV-cache round trips against independent references: an enumeration of every FP8 E4M3 value, a
textbook integer loop, and gguf-py's own Q8_0 / Q4_0 quantizers (the llama.cpp project's Python port)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from references import one_line_error

from compress.quantizers.kv_cache import FP8Rounding, KVCacheFormat, quantize_kv, scale_from_amax


def e4m3_values() -> np.ndarray:
    """Every finite non-negative float8_e4m3fn value, in code order (exponent, mantissa)."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # NaN
            if exponent == 0:
                values.append(mantissa / 8 * 2.0**-6)
            else:
                values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.array(values)


def round_e4m3(v: np.ndarray) -> np.ndarray:
    """Nearest E4M3 value, ties to the even code (mantissa), saturating at ±448."""
    grid = e4m3_values()
    out = np.empty_like(v, dtype=np.float64)
    for i, x in enumerate(np.asarray(v, dtype=np.float64).reshape(-1)):
        a = min(abs(x), 448.0)
        dist = np.abs(grid - a)
        best = np.flatnonzero(dist == dist.min())
        code = best[0] if len(best) == 1 else next(c for c in best if c % 2 == 0)
        out.reshape(-1)[i] = np.copysign(grid[code], x)
    return out


def kv(shape=(2, 3, 5, 64), seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def test_e4m3_enumeration_is_the_format():
    grid = e4m3_values()
    assert len(grid) == 127 and grid.max() == 448.0 and grid[1] == 2.0**-9
    as_torch = torch.tensor(grid, dtype=torch.float32).to(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(as_torch, grid)  # every enumerated value is representable as is


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_static_scale_matches_enumeration(per_head):
    x = kv(seed=1, scale=3.0)
    x[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-12])  # saturation both ways, zero, underflow
    scale = torch.tensor([0.01, 0.02, 0.004]) if per_head else torch.tensor([0.01])
    got = quantize_kv(x, KVCacheFormat.fp8, scale)
    s = scale.reshape(1, -1, 1, 1).float()
    ratio = (x / s).numpy()  # the float32 quotient the cache stores before rounding
    want = torch.from_numpy(round_e4m3(ratio)).float() * s
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # exact midpoints between neighbours round to the even code
    mids = torch.tensor([1.0625, 1.1875, 15.5, 240.0, 464.0, -1.0625]).reshape(1, 1, 1, -1)
    torch.testing.assert_close(quantize_kv(mids, KVCacheFormat.fp8, torch.tensor(1.0)), torch.tensor([1.0, 1.25, 16.0, 240.0, 448.0, -1.0]).reshape(1, 1, 1, -1))


def truncate_e4m3(v: np.ndarray) -> np.ndarray:
    """The largest-magnitude E4M3 value not above |v| (saturating at 448), with v's sign."""
    grid = e4m3_values()
    a = np.minimum(np.abs(np.asarray(v, dtype=np.float64)), 448.0)
    return np.copysign(grid[np.searchsorted(grid, a, side="right") - 1], v)


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_toward_zero_matches_enumeration(per_head):
    x = kv(seed=3, scale=3.0)
    x[0, 0, 0, :6] = torch.tensor([1e4, -1e4, 0.0, 1e-12, 1.0625, -1.1875])  # saturation, zero, underflow, midpoints
    scale = torch.tensor([0.01, 0.02, 0.004]) if per_head else torch.tensor([0.01])
    got = quantize_kv(x, KVCacheFormat.fp8, scale, FP8Rounding.toward_zero)
    s = scale.reshape(1, -1, 1, 1).float()
    ratio = (x * (1.0 / s)).numpy()  # vLLM's CPU cache multiplies by the scale's float32 reciprocal
    want = torch.from_numpy(truncate_e4m3(ratio)).float() * s
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got.abs() <= x.abs() + 1e-30).all()  # never away from zero
    assert (got != quantize_kv(x, KVCacheFormat.fp8, scale)).float().mean() > 0.3  # about half the values differ


def test_fp8_dynamic_scale_is_tensor_amax():
    x = kv(seed=2, scale=5.0)
    s = x.abs().max() / 448
    torch.testing.assert_close(quantize_kv(x, KVCacheFormat.fp8), quantize_kv(x, KVCacheFormat.fp8, s.reshape(1)), rtol=0, atol=0)
    assert quantize_kv(x, KVCacheFormat.fp8).abs().max() == pytest.approx(x.abs().max().item(), rel=1e-6)  # amax is on the grid


def int_reference(x: np.ndarray, bits: int, scale=None) -> np.ndarray:
    """Per (batch, head, token) row: symmetric codes, round half to even, float32 arithmetic."""
    out = np.empty_like(x, dtype=np.float32)
    qmax = 2 ** (bits - 1) - 1
    b, h, t, _ = x.shape
    for i in range(b):
        for j in range(h):
            for k in range(t):
                row = x[i, j, k].astype(np.float32)
                if scale is None:
                    s = np.float32(np.abs(row).max()) / np.float32(qmax)
                    s = s if s > 0 else np.float32(1)
                    lo, hi = -qmax, qmax
                else:
                    s = np.float32(scale[j] if len(scale) > 1 else scale[0])
                    lo, hi = -(qmax + 1), qmax
                out[i, j, k] = np.clip(np.rint(row / s), lo, hi) * s
    return out


@pytest.mark.parametrize("fmt", [KVCacheFormat.int8, KVCacheFormat.int4])
def test_int_dynamic_per_token_and_head(fmt):
    x = kv(seed=3)
    x[1, 2, 3] = 0.0  # an all-zero head vector stays zero
    got = quantize_kv(x, fmt)
    torch.testing.assert_close(got, torch.from_numpy(int_reference(x.numpy(), fmt.bits)), rtol=0, atol=0)
    assert got[1, 2, 3].abs().sum() == 0


def test_int8_static_uses_compressed_tensors_range():
    x = kv(seed=4, scale=2.0)
    scale = torch.tensor([0.01, 0.03, 0.02])
    got = quantize_kv(x, KVCacheFormat.int8, scale)
    torch.testing.assert_close(got, torch.from_numpy(int_reference(x.numpy(), 8, scale.numpy())), rtol=0, atol=0)
    assert got.min() == pytest.approx(-128 * 0.03) and got.max() == pytest.approx(127 * 0.03)


@pytest.mark.parametrize("fmt", [KVCacheFormat.q8_0, KVCacheFormat.q4_0])
def test_ggml_types_match_gguf_py(fmt):
    import gguf

    kind = gguf.GGMLQuantizationType.Q8_0 if fmt == KVCacheFormat.q8_0 else gguf.GGMLQuantizationType.Q4_0
    x = kv(shape=(2, 3, 7, 64), seed=5, scale=4.0)
    rows = x.reshape(-1, 64).numpy()
    want = gguf.quants.dequantize(gguf.quants.quantize(rows, kind), kind).reshape(x.shape)
    got = quantize_kv(x, fmt)
    np.testing.assert_array_equal(got.numpy(), want)
    assert got.dtype == x.dtype and got.shape == x.shape


def test_dtype_and_device_kept():
    x = kv(seed=6).to(torch.bfloat16)
    for fmt in KVCacheFormat:
        assert quantize_kv(x, fmt).dtype == torch.bfloat16


def test_calibrated_scales_follow_compressed_tensors():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    amax = torch.tensor([0.5, 3.0, 0.0])
    for fmt, args in ((KVCacheFormat.fp8, QuantizationArgs(num_bits=8, type="float")), (KVCacheFormat.int8, QuantizationArgs(num_bits=8, type="int"))):
        ct_scale, _ = calculate_qparams(-amax, amax, args)
        torch.testing.assert_close(scale_from_amax(amax, fmt)[:2], ct_scale[:2].float())
        assert scale_from_amax(amax, fmt)[2] > 0  # an all-zero layer gets a usable scale


def test_bad_inputs_are_one_line_errors():
    one_line_error(quantize_kv, kv(shape=(1, 2, 3, 48)), KVCacheFormat.q4_0)  # head_dim not a multiple of 32
    one_line_error(quantize_kv, kv(), KVCacheFormat.fp8, torch.ones(2))  # 2 scales for 3 heads
    one_line_error(quantize_kv, kv(), KVCacheFormat.q8_0, torch.ones(1))  # no calibrated scale for q8_0
    one_line_error(quantize_kv, torch.ones(3, 64), KVCacheFormat.int8)
    one_line_error(scale_from_amax, torch.ones(1), KVCacheFormat.int4)


def test_fp8_without_float8_dtype_is_one_line(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert "float8" in one_line_error(quantize_kv, kv(), KVCacheFormat.fp8)
