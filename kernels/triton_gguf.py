"""Triton dequant kernels for GGUF blocks: Q4_0, Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS, IQ3_S (ggml ``ggml-common.h`` /
``ggml-quants.c``).

Input: the tensor's raw bytes, uint8 ``[n_blocks · block_bytes]`` (any shape; rows of whole blocks).
Output: float32 ``[n_blocks · block_elems]``, bit-identical to gguf-py's ``gguf.quants.dequantize`` (the
ggml reference decoders, float32 with the operations in the same order):

- Q4_0  (32 elems, 18 B):  ``d`` f16, ``qs[16]``;   ``x[i] = d · (nibble_i − 8)``, low nibbles are 0..15,
  high nibbles 16..31.
- Q8_0  (32 elems, 34 B):  ``d`` f16, ``qs`` int8[32]; ``x[i] = qs[i] · d``.
- Q4_K (256 elems, 144 B): ``d``, ``dmin`` f16, ``scales[12]`` (8 six-bit scales + 8 six-bit mins),
  ``qs[128]``; element ``e``: sub-block ``j = e // 32``, byte ``qs[32·(e // 64) + e mod 32]``, high nibble
  when ``(e // 32)`` is odd; ``x = (d·sc_j)·q − (dmin·m_j)``.
- Q6_K (256 elems, 210 B): ``ql[128]``, ``qh[64]``, ``scales`` int8[16], ``d`` f16; element ``e``: half
  ``h = e // 128``, quarter ``t = (e mod 128) // 32``, ``l = e mod 32``; low 4 bits from
  ``ql[64h + 32·(t mod 2) + l] >> 4·(t // 2)``, high 2 bits from ``qh[32h + l] >> 2t``;
  ``x = (d·sc[e // 16])·(q − 32)``.
- IQ4_NL (32 elems, 18 B): ``d`` f16, ``qs[16]`` as Q4_0's; ``x[i] = d · KVALUES[nibble_i]`` (the non-uniform
  codebook ``kvalues_iq4nl``, passed in as a 16-entry int8 tensor).
- IQ4_XS (256 elems, 136 B): ``d`` f16, ``scales_h`` (uint16), ``scales_l[4]``, ``qs[128]``; element ``e``:
  block ``j = e // 32``, scale ``ls = ((scales_l[j // 2] >> 4·(j mod 2)) & 15) | (((scales_h >> 2j) & 3) << 4)``,
  nibble of ``qs[16j + e mod 16]`` (high when ``e mod 32 ≥ 16``); ``x = (d·(ls − 32))·KVALUES[q]``.
- IQ3_S (256 elems, 110 B): ``d`` f16, ``qs[64]``, ``qh[8]``, ``signs[32]``, ``scales[4]``; element ``e``: group
  ``g = e // 4`` has grid point ``qs[g] | (bit g mod 8 of qh[g // 8]) << 8``, block ``j = e // 32`` the scale
  ``sc = (scales[j // 2] >> 4·(j mod 2)) & 15``; ``x = ((d·(1 + 2·sc))·GRID[point][e mod 4])·(−1 if bit e mod 8
  of signs[e // 8] else 1)``. The 512×4 grid (ggml's ``iq3s_grid``) is gguf-py's ``quants.IQ3_S`` table,
  passed in as a uint8 tensor.

On CUDA the launch turns off fp fusion: ``a·b − c`` must not become an FMA, or Q4_K would round once
instead of twice and differ from the reference.
"""

from __future__ import annotations

import os
from enum import Enum

import torch
import triton
import triton.language as tl


class GGUFBlock(Enum):
    """Supported block types: (elements, bytes) per block and the ggml type id (Q4_0 and IQ4_NL share a geometry)."""

    Q4_0 = (32, 18, 2)
    Q8_0 = (32, 34, 8)
    Q4_K = (256, 144, 12)
    Q6_K = (256, 210, 14)
    IQ4_NL = (32, 18, 20)
    IQ4_XS = (256, 136, 23)
    IQ3_S = (256, 110, 21)

    @property
    def elems(self) -> int:
        return self.value[0]

    @property
    def size(self) -> int:
        """Bytes per block."""
        return self.value[1]

# ggml's kvalues_iq4nl (ggml/src/ggml-common.h), the codebook of IQ4_NL and IQ4_XS
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@triton.jit
def _f16(ptr, mask):
    """The little-endian float16 at ``ptr`` (two bytes), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _q4_0(data, out, n_blocks, BLOCKS: tl.constexpr):
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    e = tl.arange(0, 32)[None, :]
    ok = b < n_blocks
    base = data + b * 18
    d = _f16(base, ok)
    q = (_byte(base + 2 + e % 16, ok) >> ((e // 16) * 4)) & 15
    tl.store(out + b * 32 + e, d * (q - 8).to(tl.float32), mask=ok)


@triton.jit
def _q8_0(data, out, n_blocks, BLOCKS: tl.constexpr):
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    e = tl.arange(0, 32)[None, :]
    ok = b < n_blocks
    base = data + b * 34
    d = _f16(base, ok)
    q = _byte(base + 2 + e, ok)
    q = tl.where(q > 127, q - 256, q)  # int8 two's complement
    tl.store(out + b * 32 + e, q.to(tl.float32) * d, mask=ok)


@triton.jit
def _q4_k(data, out, n_blocks, BLOCKS: tl.constexpr):
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    e = tl.arange(0, 256)[None, :]
    ok = b < n_blocks
    base = data + b * 144
    d = _f16(base, ok)
    dmin = _f16(base + 2, ok)
    j = e // 32
    jj = j % 4
    # get_scale_min_k4: bytes 0-3 hold scales 0-3 (+2 high bits of 4-7), 4-7 mins 0-3 (+ high bits), 8-11 low nibbles of 4-7
    s_a = _byte(base + 4 + jj, ok)
    s_b = _byte(base + 8 + jj, ok)
    s_c = _byte(base + 12 + jj, ok)
    first = j < 4
    sc = tl.where(first, s_a & 63, (s_c & 15) | ((s_a >> 6) << 4))
    m = tl.where(first, s_b & 63, (s_c >> 4) | ((s_b >> 6) << 4))
    q = (_byte(base + 16 + 32 * (e // 64) + e % 32, ok) >> ((j % 2) * 4)) & 15
    y = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * m.to(tl.float32)
    tl.store(out + b * 256 + e, y, mask=ok)


@triton.jit
def _q6_k(data, out, n_blocks, BLOCKS: tl.constexpr):
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    e = tl.arange(0, 256)[None, :]
    ok = b < n_blocks
    base = data + b * 210
    d = _f16(base + 208, ok)
    h = e // 128
    t = (e % 128) // 32
    lane = e % 32
    low = (_byte(base + 64 * h + 32 * (t % 2) + lane, ok) >> ((t // 2) * 4)) & 15
    high = (_byte(base + 128 + 32 * h + lane, ok) >> (2 * t)) & 3
    q = (low | (high << 4)) - 32
    sc = _byte(base + 192 + e // 16, ok)
    sc = tl.where(sc > 127, sc - 256, sc)
    tl.store(out + b * 256 + e, (d * sc.to(tl.float32)) * q.to(tl.float32), mask=ok)


@triton.jit
def _iq4_nl(data, table, out, n_blocks, BLOCKS: tl.constexpr):
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    e = tl.arange(0, 32)[None, :]
    ok = b < n_blocks
    base = data + b * 18
    d = _f16(base, ok)
    q = (_byte(base + 2 + e % 16, ok) >> ((e // 16) * 4)) & 15
    level = tl.load(table + q, mask=ok, other=0).to(tl.float32)
    tl.store(out + b * 32 + e, d * level, mask=ok)


@triton.jit
def _iq4_xs(data, table, out, n_blocks, BLOCKS: tl.constexpr):
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    e = tl.arange(0, 256)[None, :]
    ok = b < n_blocks
    base = data + b * 136
    d = _f16(base, ok)
    j = e // 32
    scales_h = _byte(base + 2, ok) | (_byte(base + 3, ok) << 8)
    ls = ((_byte(base + 4 + j // 2, ok) >> (4 * (j % 2))) & 15) | (((scales_h >> (2 * j)) & 3) << 4)
    q = (_byte(base + 8 + 16 * j + e % 16, ok) >> (((e % 32) // 16) * 4)) & 15
    level = tl.load(table + q, mask=ok, other=0).to(tl.float32)
    tl.store(out + b * 256 + e, (d * (ls - 32).to(tl.float32)) * level, mask=ok)


@triton.jit
def _iq3_s(data, table, out, n_blocks, BLOCKS: tl.constexpr):
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    e = tl.arange(0, 256)[None, :]
    ok = b < n_blocks
    base = data + b * 110
    d = _f16(base, ok)
    g = e // 4
    j = e // 32
    point = _byte(base + 2 + g, ok) | (((_byte(base + 66 + g // 8, ok) >> (g % 8)) & 1) << 8)
    level = tl.load(table + point * 4 + e % 4, mask=ok, other=0).to(tl.float32)
    sc = (_byte(base + 106 + j // 2, ok) >> (4 * (j % 2))) & 15
    negative = (_byte(base + 74 + e // 8, ok) >> (e % 8)) & 1
    y = (d * (1 + 2 * sc).to(tl.float32)) * level
    tl.store(out + b * 256 + e, y * tl.where(negative == 1, -1.0, 1.0), mask=ok)


_KERNELS = {GGUFBlock.Q4_0: (_q4_0, 8), GGUFBlock.Q8_0: (_q8_0, 8), GGUFBlock.Q4_K: (_q4_k, 2), GGUFBlock.Q6_K: (_q6_k, 2),
            GGUFBlock.IQ4_NL: (_iq4_nl, 8), GGUFBlock.IQ4_XS: (_iq4_xs, 2), GGUFBlock.IQ3_S: (_iq3_s, 2)}


def _table(block: GGUFBlock, device) -> list[torch.Tensor]:
    """The codebook a kernel takes before ``out`` (none for the affine types)."""
    if block in (GGUFBlock.IQ4_NL, GGUFBlock.IQ4_XS):
        return [torch.tensor(IQ4_KVALUES, dtype=torch.int8, device=device)]
    if block == GGUFBlock.IQ3_S:
        from gguf.quants import IQ3_S

        IQ3_S.init_grid()
        return [torch.tensor(IQ3_S.grid.reshape(-1), dtype=torch.uint8, device=device)]
    return []


def dequantize(data: torch.Tensor, block: GGUFBlock) -> torch.Tensor:
    """Raw uint8 block bytes -> float32 ``[n_blocks · block_elems]`` (reshape to the tensor's rows)."""
    elems, size = block.elems, block.size
    if data.dtype != torch.uint8 or data.numel() % size:
        raise ValueError(f"{block.name} data must be uint8 whole blocks of {size} bytes, got {data.dtype} x {data.numel()}")
    data = data.contiguous().reshape(-1)
    n_blocks = data.numel() // size
    out = torch.empty(n_blocks * elems, dtype=torch.float32, device=data.device)
    if n_blocks == 0:
        return out
    kernel, per_program = _KERNELS[block]
    options = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}
    kernel[(triton.cdiv(n_blocks, per_program),)](data, *_table(block, data.device), out, n_blocks, BLOCKS=per_program, **options)
    return out
