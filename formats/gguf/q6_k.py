"""Q6_K: super-blocks of 256 weights in 16 sub-blocks of 16, symmetric 6-bit codes (6.5625 bpw).

Layout (``block_q6_K``): ``ql[128]``, ``qh[64]``, ``scales`` int8[16], ``d`` (f16). Half h: the low
nibbles of ``ql[64h + l]`` / ``ql[64h + 32 + l]`` are elements ``128h + l`` / ``128h + 32 + l``, their
high nibbles elements ``+64``; bits 2k of ``qh[32h + l]`` are the top 2 bits of ``128h + 32k + l``.
``x = d·sc·(q − 32)``.

Encoding follows ``quantize_row_q6_K_ref``: per sub-block ``make_qx_quants(nmax=32, rmse_type=1)``,
8-bit scales relative to the signed largest (``d = max/−128``), codes ``clamp(round(x/(d·sc)), −32,
31) + 32``. Shapes: blocks ``[N, 256]`` float32 <-> ``[N, 210]`` uint8.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, fp16_round, nearest_int, signed_absmax
from compress.formats.gguf.solvers import make_qx_quants
from compress.formats.gguf import q3_k
from compress.formats.gguf.q3_k import SGrid
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q6_K
CODES = (0, 63)  # the weight is d·sc·(code − 32)
SUB = 16


def fit_grid(blocks: np.ndarray, qw: np.ndarray | None = None) -> SGrid:
    """Sub-block fits weighted by x² (or by the importance ``qw`` ``[N, 256]`` when given)."""
    n = blocks.shape[0]
    subs = blocks.reshape(-1, SUB).astype(F32, copy=False)
    weights = None if qw is None else qw.reshape(-1, SUB)
    scales, _ = make_qx_quants(subs, 32, weights, codes=False)
    scales = scales.reshape(n, 16)
    top = signed_absmax(scales)
    zero = np.abs(top) < F32(1e-15)
    iscale = F32(-128) / np.where(zero, F32(1), top)
    sc = np.where(zero, 0, np.clip(nearest_int(iscale * scales), -128, 127)).astype(np.int8)
    d = fp16_round(np.where(zero, F32(0), F32(1) / iscale))
    grid = SGrid(d, sc)
    # ggml rounds each sub-block again with its stored scale, except where that is 0: there it keeps the sub-block
    # fit's codes (an all-but-zero super-block is written as zero bytes). Rare, so those fits are redone for them alone.
    dead = grid.scale() == 0
    if dead.any():
        fallback = np.zeros((n * 16, SUB), dtype=np.int32)
        again = np.flatnonzero((dead & ~zero).ravel())
        if again.size:
            fallback[again] = make_qx_quants(subs[again], 32, None if weights is None else weights[again])[1]
        grid = SGrid(d, sc, fallback.reshape(n, 256))
    return grid


def round_codes(blocks: np.ndarray, grid: SGrid) -> np.ndarray:
    """Codes in [0, 63] (the weight is ``step·(code − 32)``) ``[N, 256]``."""
    return q3_k.round_codes(blocks, grid, 32)


def pack(grid: SGrid, codes: np.ndarray) -> np.ndarray:
    q = codes.reshape(-1, 2, 4, 32)  # [N, half, quarter k, l]
    ql = ((q[:, :, 0:2] & 15) | ((q[:, :, 2:4] & 15) << 4)).reshape(-1, 128)
    shifts = (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None]
    qh = ((q >> 4) << shifts).sum(axis=2, dtype=np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, grid.sc.view(np.uint8), fp16_bytes(grid.d)], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks)
    return pack(grid, round_codes(blocks, grid))


def unpack(data: np.ndarray) -> tuple[SGrid, np.ndarray]:
    ql = data[:, 0:128].reshape(-1, 2, 1, 2, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    shifts = (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None]
    high = (data[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    codes = (low | (high << 4)).reshape(-1, 256)
    sc = np.ascontiguousarray(data[:, 192:208]).view(np.int8)
    return SGrid(fp16_field(data, 208), sc), codes


def decode(data: np.ndarray) -> np.ndarray:
    grid, codes = unpack(data)
    q = (codes.astype(np.int8) - np.int8(32)).reshape(-1, 16, SUB).astype(F32)
    return (grid.scale()[..., None] * q).reshape(-1, 256)


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_row_q6_K_impl``: the reference procedure with the importance as the sub-block fit's
    weights (ggml uses ``qw`` alone here, not ``qw·sqrt(σ² + x²)``)."""
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks, qw)
    return pack(grid, round_codes(blocks, grid))
