"""Triton kernels for int group-quantized weights (`GroupPacked`: compressed-tensors pack-quantized, GPTQ v1).

- `dequantize(desc, dtype) -> [N, K]`: the weight, bit-identical to the torch references
  (``formats/compressed_tensors.dequantize_pack_quantized``, ``formats/gptq.dequantize``) in float32;
  another ``dtype`` is that float32 value rounded once (as ``.to(dtype)``).
- `fused_matmul(x [M, K], desc) -> [M, N]`: W4A16-style dequant-GEMM for decode batches (M ≤ 16): each
  program dequantizes a ``[BLOCK_K, BLOCK_N]`` tile in registers and feeds ``tl.dot`` (fp32 accumulate),
  so the weight crosses memory once, packed. Split-K spreads a thin GEMM over the SMs (Marlin's
  observation: at batch 1 the work is a GEMV whose only cost is reading the weight; Frantar et al.,
  "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference", 2024).
- `matmul(x [..., K], desc, bias)`: fused for M ≤ `FUSED_MAX_M`, else dequantize to ``x.dtype`` and
  ``torch.matmul`` (a dense GEMM is compute-bound there, the one-off dequant is amortized).

Runs on CUDA, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from compress.kernels.layouts import GroupPacked

FUSED_MAX_M = 16
_SM_TARGET = 264  # programs to aim for in split-K (2 waves on a 132-SM H100/H200)


@triton.jit
def _weight_tile(
    words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx,
    n, k, k_ok, mask, group_width, zero_offset,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
):
    """Float32 ``W[n, k]`` for broadcastable index tensors ``n``, ``k`` (see layouts.py for the formula)."""
    per_word = 32 // BITS
    code_mask = (1 << BITS) - 1
    word = tl.load(words + (k // per_word) * sw_k + n * sw_n, mask=mask, other=0)
    code = (word >> ((k % per_word) * BITS)) & code_mask  # the mask drops the arithmetic shift's sign bits
    if HAS_GIDX:
        g = tl.load(g_idx + k, mask=k_ok, other=0)
    else:
        g = k // group_width
    scale = tl.load(scales + g * ss_g + n * ss_n, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zword = tl.load(zeros + g * sz_g + (n // per_word) * sz_n, mask=mask, other=0)
        zero = ((zword >> ((n % per_word) * BITS)) & code_mask) + zero_offset
    else:
        zero = tl.full(code.shape, 1 << (BITS - 1), tl.int32)
    # (c - z) * s in float32, the references' order: c - z is exact, one rounding in the product
    return (code.to(tl.float32) - zero.to(tl.float32)) * scale


@triton.jit
def _cast(w, dtype: tl.constexpr):
    """float32 -> ``dtype`` rounding to nearest even. bfloat16 is rounded by hand: Triton's interpreter
    truncates it (numpy has no bfloat16), and the GPU must give the same bits as the tests saw."""
    if dtype == tl.bfloat16:
        u = w.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # finite inputs only: dequantized weights are finite
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return w.to(dtype)


@triton.jit
def _dequant_kernel(
    words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, out,
    N, K, group_width, zero_offset,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    k_ok = k < K
    mask = (n < N) & k_ok
    w = _weight_tile(words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx,
                     n, k, k_ok, mask, group_width, zero_offset, BITS, HAS_ZEROS, HAS_GIDX)
    tl.store(out + n * K + k, _cast(w, out.dtype.element_ty), mask=mask)


@triton.jit
def _fused_kernel(
    x, sx_m, sx_k, words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, acc_out,
    M, N, K, k_per_split, group_width, zero_offset,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``acc_out [M, N]`` float32 (+)= ``x[:, ks] @ W[:, ks].T`` over this program's K slice."""
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x + m[:, None] * sx_m + k[None, :] * sx_k, mask=(m[:, None] < M) & k_ok[None, :], other=0.0)
        kk = k[:, None]
        w = _weight_tile(words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx,
                         n[None, :], kk, kk < K, (kk < K) & (n[None, :] < N), group_width, zero_offset,
                         BITS, HAS_ZEROS, HAS_GIDX)
        # the weight in the activation dtype (as the dequant-then-matmul path does), fp32 accumulation
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        elif INTERPRET:  # the interpreter's bf16 dot is wrong; bf16·bf16 products are exact in fp32 anyway
            acc += tl.dot(a.to(tl.float32), _cast(w, a.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, _cast(w, a.dtype))
    ptrs = acc_out + m[:, None] * N + n[None, :]
    ok = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT:
        tl.atomic_add(ptrs, acc, mask=ok)
    else:
        tl.store(ptrs, acc, mask=ok)


def _args(desc: GroupPacked) -> tuple:
    dummy = desc.words  # never read when the flag is off; Triton needs a pointer
    zeros = desc.zeros if desc.zeros is not None else dummy
    g_idx = desc.g_idx if desc.g_idx is not None else dummy
    return (desc.words, *desc.word_strides, desc.scales, *desc.scale_strides, zeros, *desc.zero_strides, g_idx)


def dequantize(desc: GroupPacked, dtype: torch.dtype = torch.float32, block_n: int = 32, block_k: int = 64) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype`` (float32: bit-identical to the torch reference)."""
    n, k = desc.out_features, desc.in_features
    out = torch.empty(n, k, dtype=dtype, device=desc.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        *_args(desc), out, n, k, desc.group_width, desc.zero_offset,
        BITS=desc.bits, HAS_ZEROS=desc.zeros is not None, HAS_GIDX=desc.g_idx is not None,
        BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def _split_k(n_programs: int, k_blocks: int) -> int:
    """How many K slices: enough programs to fill the GPU, each slice still a few K blocks long."""
    return max(1, min(k_blocks // 4, triton.cdiv(_SM_TARGET, n_programs)))


def fused_matmul(x: torch.Tensor, desc: GroupPacked, block_n: int = 64, block_k: int = 64, split_k: int | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype``, dequantizing inside the GEMM (meant for M ≤ 16)."""
    if x.dim() != 2 or x.shape[1] != desc.in_features:
        raise ValueError(f"x must be [M, {desc.in_features}], got {list(x.shape)}")
    m, n, k = x.shape[0], desc.out_features, desc.in_features
    block_m = 16  # tl.dot's smallest tile; rows past M are masked
    k_blocks = triton.cdiv(k, block_k)
    grid_nm = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = split_k if split_k is not None else _split_k(grid_nm, k_blocks)
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(k, k_per_split)
    acc = (torch.zeros if split > 1 else torch.empty)(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _fused_kernel[grid](
        x, x.stride(0), x.stride(1), *_args(desc), acc,
        m, n, k, k_per_split, desc.group_width, desc.zero_offset,
        BITS=desc.bits, HAS_ZEROS=desc.zeros is not None, HAS_GIDX=desc.g_idx is not None, SPLIT=split > 1,
        IEEE=x.dtype == torch.float32, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return acc.to(x.dtype)


def matmul(x: torch.Tensor, desc: GroupPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]``: fused dequant-GEMM for small batches, dequantize + matmul for large."""
    bias = None if bias is None else bias.to(x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > FUSED_MAX_M:
        # F.linear on the reference forward's weight bits: identical results, not just close
        return torch.nn.functional.linear(x, dequantize(desc, x.dtype), bias)
    y = fused_matmul(x2, desc)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], desc.out_features)
