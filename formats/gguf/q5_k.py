"""Q5_K: super-blocks of 256 weights in 8 sub-blocks of 32, 5-bit codes (5.5 bpw).

Layout (``block_q5_K``): ``d`` (f16), ``dmin`` (f16), ``scales[12]`` (as Q4_K), ``qh[32]`` (bit j of
``qh[l]`` is the 5th bit of element ``32j + l``), ``qs[128]`` (low nibbles in Q4_K's order).
``x = d·sc_j·q − dmin·m_j``. Encoding follows ``quantize_row_q5_K_ref``: Q4_K's procedure with
``make_qkx2_quants(nmax=31, rmin=−0.5, nstep=15)``.
Shapes: blocks ``[N, 256]`` float32 <-> ``[N, 176]`` uint8.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf import q4_k
from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, nibbles, pack_k_scales, unpack_k_scales
from compress.formats.gguf.q4_k import SUB, KGrid
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q5_K
CODES = (0, 31)  # the weight is d·sc·code − dmin·m


def fit_grid(blocks: np.ndarray) -> KGrid:
    return q4_k.fit_sub_blocks(blocks, nmax=31, rmin=-0.5, nstep=15)


def round_codes(blocks: np.ndarray, grid: KGrid) -> np.ndarray:
    return q4_k.round_codes(blocks, grid, nmax=31)


def pack(grid: KGrid, codes: np.ndarray) -> np.ndarray:
    q = codes.reshape(-1, 4, 2, 32)
    qs = nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    high = (codes.reshape(-1, 8, 32) >> 4) & 1  # [N, j, l]: bit j of qh[l]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    parts = [fp16_bytes(grid.d), fp16_bytes(grid.dmin), pack_k_scales(grid.sc, grid.m), qh, qs]
    return np.concatenate(parts, axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks)
    return pack(grid, round_codes(blocks, grid))


def unpack(data: np.ndarray) -> tuple[KGrid, np.ndarray]:
    sc, m = unpack_k_scales(data[:, 4:16])
    qh = data[:, 16:48]
    qs = data[:, 48:176].reshape(-1, 4, 1, 32)
    low = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = (low | (high << 4)).reshape(-1, 256)
    return KGrid(fp16_field(data, 0), fp16_field(data, 2), sc, m), codes


def decode(data: np.ndarray) -> np.ndarray:
    grid, codes = unpack(data)
    q = codes.reshape(-1, 8, SUB).astype(F32)
    return (grid.scale()[..., None] * q - grid.offset()[..., None]).reshape(-1, 256)


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_row_q5_K_impl``: Q4_K's importance-weighted fit with 5-bit codes."""
    grid = q4_k.fit_sub_blocks_weighted(blocks, qw, 31)
    return pack(grid, round_codes(blocks, grid))
