"""Triton dequant kernels for the float layouts (`FloatPacked`: compressed-tensors float-quantized FP8 and
nvfp4- / mxfp4-pack-quantized; see ``formats/ct_float.py``).

- FP8 E4M3 bytes ``[N, K]`` with float32 scales, one per ``row_block × col_block`` tile (per channel
  ``1 × K``, per tensor ``N × K``, DeepSeek-style blocks ``128 × 128``): ``W[n, k] = e4m3(byte) · s[n // bh, k // bw]``.
- FP4 E2M1 nibbles (two per byte, column ``2j`` low) with a scale per 16 or 32 columns: NVFP4's E4M3 byte
  divided by the float32 global scale (``ŝ / g``, rounded to nearest: ``div_rn``), or MXFP4's E8M0 byte
  ``2^(byte − 127)``: ``W[n, k] = e2m1(nibble) · scale``.

Elements and scales are decoded from their bits with integer operations (exact, and the same under Triton's
interpreter, whose numpy has no float8), then multiplied once in float32, the references' operation order:
float32 output is bit-identical to ``ct_float.dequantize_fp8`` / ``dequantize_fp4``; bfloat16/float16 output
is that value rounded once. Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compress.kernels.layouts import FloatPacked
from compress.quantizers.float_grid import FloatGrid
from compress.kernels.triton_int import _cast


@triton.jit
def _e4m3(byte):
    """Float32 value of E4M3 bytes (int32 0..255): normal from the bit fields, subnormal m · 2⁻⁹, S.1111.111 NaN."""
    sign = (byte >> 7) << 31
    field = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (sign | ((field + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)  # exponent field − 7 + 127
    tiny = mantissa.to(tl.float32) * 0.001953125  # 2^-9, exact
    tiny = tl.where(sign != 0, -tiny, tiny)
    value = tl.where(field == 0, tiny, normal)
    return tl.where((field == 15) & (mantissa == 7), float("nan"), value)


@triton.jit
def _e2m1(nibble):
    """Float32 value of E2M1 nibbles (int32 0..15): 0, ±0.5 (subnormal), ±{1, 1.5, 2, 3, 4, 6}."""
    sign = (nibble >> 3) << 31
    field = (nibble >> 1) & 3
    mantissa = nibble & 1
    normal = (sign | ((field + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)  # exponent field − 1 + 127
    half = mantissa.to(tl.float32) * 0.5
    half = tl.where(sign != 0, -half, half)
    return tl.where(field == 0, half, normal)


@triton.jit
def _fp8_kernel(
    weight, sw_n, sw_k, scales, ss_r, ss_c, out, N, K, row_block, col_block,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    mask = (n < N) & (k < K)
    byte = tl.load(weight + n * sw_n + k * sw_k, mask=mask, other=0).to(tl.int32) & 0xFF
    scale = tl.load(scales + (n // row_block) * ss_r + (k // col_block) * ss_c, mask=mask, other=0.0)
    tl.store(out + n * K + k, _cast(_e4m3(byte) * scale, out.dtype.element_ty), mask=mask)


@triton.jit
def _fp4_kernel(
    packed, sp_n, sp_k, scales, ss_n, ss_g, global_scale, out, N, K, group,
    MX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    mask = (n < N) & (k < K)
    byte = tl.load(packed + n * sp_n + (k // 2) * sp_k, mask=mask, other=0).to(tl.int32) & 0xFF
    nibble = (byte >> ((k % 2) * 4)) & 15
    scale_byte = tl.load(scales + n * ss_n + (k // group) * ss_g, mask=mask, other=0).to(tl.int32) & 0xFF
    if MX:  # 2^(byte - 127) from the exponent bits; byte 0 is the subnormal 2^-127
        scale = tl.where(scale_byte == 0, 0x00400000, scale_byte << 23).to(tl.float32, bitcast=True)
    else:
        scale = tl.div_rn(_e4m3(scale_byte), tl.load(global_scale))
    tl.store(out + n * K + k, _cast(_e2m1(nibble) * scale, out.dtype.element_ty), mask=mask)


def dequantize(desc: FloatPacked, dtype: torch.dtype = torch.float32, block_n: int = 32, block_k: int = 64) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype`` (float32: bit-identical to the torch reference)."""
    n, k = desc.out_features, desc.in_features
    out = torch.empty(n, k, dtype=dtype, device=desc.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    codes = desc.codes.view(torch.uint8)
    if desc.grid is FloatGrid.FP8:
        scales = desc.scales.float().reshape(-1, desc.scales.shape[-1])
        strides = (0, 0) if scales.numel() == 1 else scales.stride()
        _fp8_kernel[grid](codes, *codes.stride(), scales, *strides, out, n, k, desc.row_block, desc.col_block,
                          BLOCK_N=block_n, BLOCK_K=block_k)
        return out
    scales = desc.scales.view(torch.uint8)
    global_scale = desc.global_scale.float() if desc.global_scale is not None else scales  # unread for MXFP4
    _fp4_kernel[grid](codes, *codes.stride(), scales, *scales.stride(), global_scale, out, n, k, desc.col_block,
                      MX=desc.grid is FloatGrid.MXFP4, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def matmul(x: torch.Tensor, desc: FloatPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]``: the weight dequantized to ``x.dtype``, then ``F.linear`` (the reference's bits)."""
    return torch.nn.functional.linear(x, dequantize(desc, x.dtype), None if bias is None else bias.to(x.dtype))
