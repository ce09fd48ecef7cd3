"""Triton kernels for int group-quantized weights (`GroupPacked`: compressed-tensors pack-quantized, GPTQ v1).

- `dequantize(desc, dtype) -> [N, K]`: the weight, bit-identical to the torch references
  (``formats/compressed_tensors.dequantize_pack_quantized``, ``formats/gptq.dequantize``) in float32;
  another ``dtype`` is that float32 value rounded once (as ``.to(dtype)``).
- `fused_matmul(x [M, K], desc) -> [M, N]`: W4A16-style dequant-GEMM for decode batches (M ≤ 16): each
  program dequantizes a ``[BLOCK_K, BLOCK_N]`` tile in registers and feeds ``tl.dot`` (fp32 accumulate),
  so the weight crosses memory once, packed. Split-K spreads a thin GEMM over the SMs (Marlin's
  observation: at batch 1 the work is a GEMV whose only cost is reading the weight; Frantar et al.,
  "MARLIN: Mixed-Precision Auto-Regressive Parallel Inference", 2024).
- `gemv(x [M, K], desc) -> [M, N]`: the decode case (M ≤ `GEMV_MAX_M`) without ``tl.dot``: a 16-row MMA tile
  wastes 15/16 of its work at batch 1 and the dequant arithmetic, not the weight traffic, bounds the fused
  kernel there. Per tile inside one group the scale and zero are factored out of the sum,
  ``Σ_k (c−z)·s·x_k = s·(Σ_k c·x_k − z·Σ_k x_k)``, so a code costs a shift, a mask, a conversion and a
  multiply-add, and the codes stay in the ``[word, code of the word, n]`` shape they are unpacked in (no
  reshape, no layout change). The sum runs in float32 on the exact weight, without rounding it to ``x.dtype``.
- `matmul(x [..., K], desc, bias)`: gemv for M ≤ `GEMV_MAX_M`, fused for M ≤ `FUSED_MAX_M`, else dequantize to
  ``x.dtype`` and ``torch.matmul`` (a dense GEMM is compute-bound there, the one-off dequant is amortized).

Runs on CUDA, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, how the tests run it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from compress.kernels.layouts import GroupPacked

GEMV_MAX_M = 4
FUSED_MAX_M = 16
BLOCK_M = 16  # tl.dot's smallest tile; rows past M are masked
TUNE_MIN_WEIGHTS = 1 << 20
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton itself does at import


@triton.jit
def _codes(words, sw_k, sw_n, k0, n, K, N, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
           UNPACK: tl.constexpr):
    """int32 codes ``c[k, n]`` of columns ``k0 .. k0 + BLOCK_K`` and rows ``n`` as a ``[BLOCK_K, BLOCK_N]`` tile.

    UNPACK loads each packed word once (a ``[BLOCK_K / per_word, BLOCK_N]`` tile) and splits it by shifts;
    otherwise every code loads its own word (the same address ``per_word`` times, served by the cache)."""
    per_word: tl.constexpr = 32 // BITS
    code_mask: tl.constexpr = (1 << BITS) - 1
    if UNPACK:
        kw = k0 // per_word + tl.arange(0, BLOCK_K // per_word)
        ok = (kw[:, None] < tl.cdiv(K, per_word)) & (n[None, :] < N)
        word = tl.load(words + kw[:, None] * sw_k + n[None, :] * sw_n, mask=ok, other=0)
        shifts = tl.arange(0, per_word) * BITS
        codes = (word[:, None, :] >> shifts[None, :, None]) & code_mask  # the mask drops the sign bits
        return tl.reshape(codes, (BLOCK_K, BLOCK_N))
    k = k0 + tl.arange(0, BLOCK_K)[:, None]
    word = tl.load(words + (k // per_word) * sw_k + n[None, :] * sw_n, mask=(k < K) & (n[None, :] < N), other=0)
    return (word >> ((k % per_word) * BITS)) & code_mask


@triton.jit
def _weight_tile(
    words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, k0, n, K, N, zero_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, UNPACK: tl.constexpr,
):
    """Float32 ``W[n, k]`` transposed, ``[BLOCK_K, BLOCK_N]`` (see layouts.py for the formula).

    Without g_idx and with groups a multiple of BLOCK_K (tiles start at multiples of BLOCK_K), the tile lies in one
    group: one row of scales (and zeros) serves it; otherwise each column looks its group up."""
    per_word: tl.constexpr = 32 // BITS
    code_mask: tl.constexpr = (1 << BITS) - 1
    code = _codes(words, sw_k, sw_n, k0, n, K, N, BITS, BLOCK_K, BLOCK_N, UNPACK)
    k = k0 + tl.arange(0, BLOCK_K)
    n_row = n[None, :]
    if HAS_GIDX:
        g = tl.load(g_idx + k, mask=k < K, other=0)[:, None]
        ok = (k[:, None] < K) & (n_row < N)
    elif GROUP % BLOCK_K == 0:
        g = k0 // GROUP
        ok = n_row < N
    else:
        g = (k // GROUP)[:, None]
        ok = (k[:, None] < K) & (n_row < N)
    scale = tl.load(scales + g * ss_g + n_row * ss_n, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zword = tl.load(zeros + g * sz_g + (n_row // per_word) * sz_n, mask=ok, other=0)
        zero = (((zword >> ((n_row % per_word) * BITS)) & code_mask) + zero_offset).to(tl.float32)
    else:
        zero = tl.full((1, 1), 1 << (BITS - 1), tl.float32)  # the symmetric grid's midpoint
    # (c - z) * s in float32, the references' order: c - z is exact, one rounding in the product
    return (code.to(tl.float32) - zero) * scale


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
def _round(w, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """`_cast` under the interpreter; the hardware's round-to-nearest-even conversion (the same bits) on a GPU."""
    if INTERPRET:
        return _cast(w, dtype)
    return w.to(dtype)


@triton.jit
def _dequant_kernel(
    words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, out, N, K, zero_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)[:, None]
    w = _weight_tile(words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, k0, n, K, N, zero_offset,
                     BITS, GROUP, HAS_ZEROS, HAS_GIDX, BLOCK_K, BLOCK_N, UNPACK)
    tl.store(out + n[None, :] * K + k, _round(w, out.dtype.element_ty, INTERPRET), mask=(k < K) & (n[None, :] < N))


@triton.jit
def _k_share(K, BLOCK_K: tl.constexpr, SPLIT_AXIS: tl.constexpr):
    """This program's K blocks ``[first, last)`` under split-K (the grid's axis ``SPLIT_AXIS`` counts the slices)."""
    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, tl.num_programs(SPLIT_AXIS))
    first = tl.program_id(SPLIT_AXIS) * per_split
    return first, tl.minimum(first + per_split, k_blocks)


@triton.jit
def _emit(ptrs, acc, ok, SPLIT_AXIS: tl.constexpr):
    """The partial sums out: added atomically where several K slices share the output (the buffer is zeroed)."""
    if tl.num_programs(SPLIT_AXIS) > 1:
        tl.atomic_add(ptrs, acc, mask=ok)
    else:
        tl.store(ptrs, acc, mask=ok)


@triton.jit
def _fused_kernel(
    x, sx_m, sx_k, words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, acc_out, M, N, K, zero_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UNPACK: tl.constexpr,
):
    """``acc_out [M, N]`` float32 (zeroed) += ``x[:, ks] @ W[:, ks].T`` over this program's share of the K blocks."""
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first, last = _k_share(K, BLOCK_K, 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first, last):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(x + m[:, None] * sx_m + k[None, :] * sx_k, mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = _weight_tile(words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, kb * BLOCK_K, n, K, N,
                         zero_offset, BITS, GROUP, HAS_ZEROS, HAS_GIDX, BLOCK_K, BLOCK_N, UNPACK)
        # the weight in the activation dtype (as the dequant-then-matmul path does), fp32 accumulation
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        elif INTERPRET:  # the interpreter's bf16 dot is wrong; bf16·bf16 products are exact in fp32 anyway
            acc += tl.dot(a.to(tl.float32), _cast(w, a.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    _emit(acc_out + m[:, None] * N + n[None, :], acc, (m[:, None] < M) & (n[None, :] < N), 2)


@triton.jit
def _gemv_kernel(
    x, sx_m, sx_k, words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, acc_out, M, N, K, zero_offset,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
    INTERPRET: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNPACK: tl.constexpr,
    WAVES: tl.constexpr, EVEN_K: tl.constexpr,
):
    """``acc_out [M, N]`` float32 (zeroed) += ``x[:, ks] @ W[:, ks].T`` over this program's share of the K blocks,
    as broadcast products and sums (``ROWS`` ≥ M rows, a power of two)."""
    per_word: tl.constexpr = 32 // BITS
    code_mask: tl.constexpr = (1 << BITS) - 1
    rows = tl.arange(0, ROWS)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first, last = _k_share(K, BLOCK_K, 1)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for kb in range(first, last):
        if (GROUP % BLOCK_K == 0) & (HAS_GIDX == 0):  # the tile lies in one group: factor s and z out
            # codes as [words, per_word, n] and activations as [rows, words, per_word]: no reshape, so no
            # register shuffle; the sum over a word's codes stays in one thread
            kw = kb * (BLOCK_K // per_word) + tl.arange(0, BLOCK_K // per_word)
            j = tl.arange(0, per_word)
            # without a K mask when K is a multiple of BLOCK_K: a mask that varies along the words stops vector loads
            if EVEN_K:
                word = tl.load(words + kw[:, None] * sw_k + n[None, :] * sw_n, mask=n[None, :] < N, other=0)
            else:
                word = tl.load(words + kw[:, None] * sw_k + n[None, :] * sw_n,
                               mask=(kw[:, None] < tl.cdiv(K, per_word)) & (n[None, :] < N), other=0)
            c = ((word[:, None, :] >> (j * BITS)[None, :, None]) & code_mask).to(tl.float32)  # [KW, PW, BLOCK_N]
            kk = kw[:, None] * per_word + j[None, :]
            a3 = tl.load(x + rows[:, None, None] * sx_m + kk[None, :, :] * sx_k,
                         mask=(rows[:, None, None] < M) & (kk[None, :, :] < K), other=0.0).to(tl.float32)
            dot = tl.sum(tl.sum(a3[:, :, :, None] * c[None, :, :, :], axis=2), axis=1)  # [ROWS, BLOCK_N]
            g = kb * BLOCK_K // GROUP
            scale = tl.load(scales + g * ss_g + n * ss_n, mask=n < N, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zword = tl.load(zeros + g * sz_g + (n // per_word) * sz_n, mask=n < N, other=0)
                zero = (((zword >> ((n % per_word) * BITS)) & code_mask) + zero_offset).to(tl.float32)
            else:
                zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
            acc += (dot - zero[None, :] * tl.sum(tl.sum(a3, axis=2), axis=1)[:, None]) * scale[None, :]
        else:  # columns of several groups (or act-order's g_idx): each weight dequantized on its own
            k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(x + rows[:, None] * sx_m + k[None, :] * sx_k, mask=(rows[:, None] < M) & (k[None, :] < K),
                        other=0.0).to(tl.float32)  # [ROWS, BLOCK_K]
            w = _weight_tile(words, sw_k, sw_n, scales, ss_g, ss_n, zeros, sz_g, sz_n, g_idx, kb * BLOCK_K, n, K, N,
                             zero_offset, BITS, GROUP, HAS_ZEROS, HAS_GIDX, BLOCK_K, BLOCK_N, UNPACK)
            acc += tl.sum(a[:, :, None] * w[None, :, :], axis=1)
    _emit(acc_out + rows[:, None] * N + n[None, :], acc, (rows[:, None] < M) & (n[None, :] < N), 1)


# Tile shapes the GPU autotuner tries (per N, K): the word-unpacking and the per-code loads, narrow and wide tiles.
def _configs(shapes, warps_stages) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "UNPACK": unpack}, num_warps=w, num_stages=st)
            for bn, bk in shapes for unpack in (1, 0) for w, st in warps_stages]


FUSED_CONFIGS = (_configs([(64, 128), (128, 128), (64, 256), (32, 256)], [(4, 3)]) + _configs([(128, 256)], [(8, 3)])
                 + _configs([(32, 128), (16, 256)], [(2, 4)]))
DEQUANT_CONFIGS = _configs([(64, 64), (128, 64), (64, 128)], [(4, 2)])
# GEMV: 128-256 codes per thread (fewest instructions per code, read from the PTX), K tiles no wider than a group;
# WAVES: programs per SM the split-K aims for
GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "UNPACK": 1, "WAVES": waves}, num_warps=w, num_stages=3)
                for bn, bk, w in [(128, 32, 1), (256, 32, 2), (64, 64, 1), (128, 64, 2), (256, 64, 2), (64, 128, 1),
                                  (128, 128, 2), (256, 128, 4), (64, 256, 4)]
                for waves in (2, 8)]


def _prune_gemv(configs, named_args, **kwargs):
    """Tiles inside one group (the factored path) where the layer has no g_idx and some fit; else all."""
    args = {**named_args, **kwargs}
    fit = [c for c in configs if args["GROUP"] % c.kwargs["BLOCK_K"] == 0]
    return fit if fit and not args["HAS_GIDX"] else configs


_gemv_even = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_gemv_kernel)
_gemv_tuned = triton.autotune(GEMV_CONFIGS, key=["N", "K", "ROWS"], reset_to_zero=["acc_out"],
                              prune_configs_by={"early_config_prune": _prune_gemv})(_gemv_even)
_fused_tuned = triton.autotune(FUSED_CONFIGS, key=["N", "K"], reset_to_zero=["acc_out"])(_fused_kernel)
_dequant_tuned = triton.autotune(DEQUANT_CONFIGS, key=["N", "K"])(_dequant_kernel)


def _args(desc: GroupPacked) -> tuple:
    dummy = desc.words  # never read when the flag is off; Triton needs a pointer
    zeros = desc.zeros if desc.zeros is not None else dummy
    g_idx = desc.g_idx if desc.g_idx is not None else dummy
    return (desc.words, *desc.word_strides, desc.scales, *desc.scale_strides, zeros, *desc.zero_strides, g_idx)


def _flags(desc: GroupPacked) -> dict:
    return dict(BITS=desc.bits, GROUP=desc.group_width, HAS_ZEROS=desc.zeros is not None,
                HAS_GIDX=desc.g_idx is not None, INTERPRET=INTERPRET)


def _tile(block_n: int | None, block_k: int | None, unpack: bool | None, default: tuple[int, int],
          weights: int, extra: dict | None = None) -> dict | None:
    """Explicit tile meta-parameters, or None to let the autotuner choose: on a GPU, for a weight of at least
    `TUNE_MIN_WEIGHTS` (tuning compiles every config once per layout: worth it for real layers only)."""
    if block_n is None and block_k is None and unpack is None and not INTERPRET and weights >= TUNE_MIN_WEIGHTS:
        return None
    return {"BLOCK_N": block_n or default[0], "BLOCK_K": block_k or default[1], "UNPACK": True if unpack is None else unpack,
            **(extra or {})}


def dequantize(desc: GroupPacked, dtype: torch.dtype = torch.float32, block_n: int | None = None,
               block_k: int | None = None, unpack: bool | None = None) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype`` (float32: bit-identical to the torch reference)."""
    n, k = desc.out_features, desc.in_features
    out = torch.empty(n, k, dtype=dtype, device=desc.device)
    tile = _tile(block_n, block_k, unpack, (32, 64), n * k)
    kernel = _dequant_tuned if tile is None else _dequant_kernel
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"]))  # noqa: E731
    kernel[grid](*_args(desc), out, n, k, desc.zero_offset, **_flags(desc), **(tile or {}))
    return out


def _split_k(n_programs: int, k_blocks: int, target: int) -> int:
    """How many K slices: enough programs to fill the GPU twice, each slice still two K blocks or more."""
    return max(1, min(k_blocks // 2, triton.cdiv(target, n_programs)))


@functools.cache  # asked on every decode step: the device's SM count does not change
def _program_target(device: torch.device) -> int:
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def fused_matmul(x: torch.Tensor, desc: GroupPacked, block_n: int | None = None, block_k: int | None = None,
                 split_k: int | None = None, unpack: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype``, dequantizing inside the GEMM (meant for M ≤ 16)."""
    if x.dim() != 2 or x.shape[1] != desc.in_features:
        raise ValueError(f"x must be [M, {desc.in_features}], got {list(x.shape)}")
    m, n, k = x.shape[0], desc.out_features, desc.in_features
    target = _program_target(x.device)

    def grid(meta):
        tiles = triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, BLOCK_M)
        split = split_k or _split_k(tiles, triton.cdiv(k, meta["BLOCK_K"]), target)
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, BLOCK_M), split

    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    tile = _tile(block_n, block_k, unpack, (64, 64), n * k)
    kernel = _fused_tuned if tile is None else _fused_kernel
    kernel[grid](x, x.stride(0), x.stride(1), *_args(desc), acc, m, n, k, desc.zero_offset, **_flags(desc),
                 IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, **(tile or {}))
    return acc.to(x.dtype)


def gemv(x: torch.Tensor, desc: GroupPacked, block_n: int | None = None, block_k: int | None = None,
         split_k: int | None = None, unpack: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in ``x.dtype`` for decode batches (M ≤ `GEMV_MAX_M`), float32 sums."""
    if x.dim() != 2 or x.shape[1] != desc.in_features or x.shape[0] > GEMV_MAX_M:
        raise ValueError(f"x must be [M <= {GEMV_MAX_M}, {desc.in_features}], got {list(x.shape)}")
    m, n, k = x.shape[0], desc.out_features, desc.in_features
    target = _program_target(x.device) // 2  # programs per SM, times WAVES

    def grid(meta):
        tiles = triton.cdiv(n, meta["BLOCK_N"])
        return tiles, split_k or _split_k(tiles, triton.cdiv(k, meta["BLOCK_K"]), target * meta["WAVES"])

    acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    tile = _tile(block_n, block_k, unpack, (32, 64), n * k, extra={"WAVES": 2})
    kernel = _gemv_tuned if tile is None else _gemv_even
    kernel[grid](x, x.stride(0), x.stride(1), *_args(desc), acc, m, n, k, desc.zero_offset, **_flags(desc),
                 ROWS=triton.next_power_of_2(m), **(tile or {}))
    return acc.to(x.dtype)


def matmul(x: torch.Tensor, desc: GroupPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] -> [..., N]``: gemv for decode batches, fused dequant-GEMM for small ones, dequantize +
    matmul for large."""
    bias = None if bias is None else bias.to(x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > FUSED_MAX_M:
        # F.linear on the reference forward's weight bits: identical results, not just close
        return torch.nn.functional.linear(x, dequantize(desc, x.dtype), bias)
    y = gemv(x2, desc) if x2.shape[0] <= GEMV_MAX_M else fused_matmul(x2, desc)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], desc.out_features)
