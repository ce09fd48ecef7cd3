"""Q3_K: super-blocks of 256 weights in 16 sub-blocks of 16, symmetric 3-bit codes (3.4375 bpw).

Layout (``block_q3_K``): ``hmask[32]`` (element ``32k + l`` takes bit k of ``hmask[l]``), ``qs[64]``
(low 2 bits, Q2_K's order), ``scales[12]`` (16 six-bit scales stored +32: low nibbles in bytes 0-7,
2-bit highs in bytes 8-11), ``d`` (f16). ``x = d·(sc − 32)·(q − 4)`` where q = low | high << 2.

Encoding follows ``quantize_row_q3_K_ref``: per sub-block ``make_q3_quants(nmax=4)`` (x²-weighted
coordinate descent), 6-bit scales relative to the signed largest one (``d = max/−32``), then codes
``clamp(round(x/(d·sc)), −4, 3)``. Shapes: blocks ``[N, 256]`` float32 <-> ``[N, 110]`` uint8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compress.formats.gguf._common import (
    F32, _running_sum, as_torch, fp16_bytes, fp16_field, fp16_round, importance_weights, mean_square, nearest_int, signed_absmax,
)
from compress.formats.gguf.solvers import make_q3_quants, make_qx_quants
from compress.formats.gguf.q2_k import pack_crumbs, unpack_crumbs
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q3_K
CODES = (0, 7)  # the weight is d·sc·(code − 4)
SUB = 16


@dataclass(frozen=True)
class SGrid:
    """Symmetric super-block grid: float16 ``d`` ``[N, 1]`` and signed sub-block scales ``[N, 16]``."""

    d: np.ndarray
    sc: np.ndarray
    fallback: np.ndarray | None = None  # codes where the step is 0, as `KGrid.fallback`

    def scale(self) -> np.ndarray:
        return self.d * self.sc.astype(F32)


def fit_grid(blocks: np.ndarray) -> SGrid:
    n = blocks.shape[0]
    scales, first = make_q3_quants(blocks.reshape(-1, SUB).astype(F32, copy=False), 4)
    scales = scales.reshape(n, 16)
    top = signed_absmax(scales)
    zero = top == 0
    iscale = F32(-32) / np.where(zero, F32(1), top)
    sc = np.clip(nearest_int(iscale * scales), -32, 31)
    d = np.where(zero, F32(0), F32(1) / iscale)
    # ggml leaves an all-zero super-block's scale bytes at 0, i.e. stored scales of −32
    return SGrid(fp16_round(d), np.where(zero, -32, sc).astype(np.int8), first.reshape(n, 256))


def round_codes(blocks: np.ndarray, grid: SGrid, half: int = 4) -> np.ndarray:
    """Codes in [0, 2·half − 1] (stored value; the weight is ``step·(code − half)``) ``[N, 256]``;
    Q6_K shares this with ``half`` 32."""
    n = blocks.shape[0]
    step = grid.scale()[..., None]
    dead = step == 0
    q = as_torch(blocks).view(n, 16, SUB) / torch.from_numpy(np.where(dead, F32(1), step))
    codes = q.round_().clamp_(-half, half - 1).add_(half).to(torch.uint8).numpy()
    if dead.any():
        codes = np.where(dead, half if grid.fallback is None else grid.fallback.reshape(n, 16, SUB), codes)
    return codes.reshape(n, 256).astype(np.uint8, copy=False)


def pack_scales(sc: np.ndarray) -> np.ndarray:
    u = (sc.astype(np.int16) + 32).astype(np.uint8)  # [N, 16], 6 bits each
    low = (u[:, :8] & 15) | ((u[:, 8:] & 15) << 4)
    hi = (u >> 4).reshape(-1, 4, 4)  # [N, j // 4, j % 4]
    high = (hi << (np.arange(4, dtype=np.uint8) * 2)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([low, high], axis=1)


def unpack_scales(packed: np.ndarray) -> np.ndarray:
    low = np.concatenate([packed[:, :8] & 15, packed[:, :8] >> 4], axis=1)
    shifts = (np.arange(4, dtype=np.uint8) * 2)[None, :, None]
    high = ((packed[:, None, 8:12] >> shifts) & 3).reshape(-1, 16)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)


def pack(grid: SGrid, codes: np.ndarray) -> np.ndarray:
    high = (codes.reshape(-1, 8, 32) >> 2) & 1  # [N, k, l]: bit k of hmask[l]
    hmask = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    parts = [hmask, pack_crumbs(codes & 3), pack_scales(grid.sc), fp16_bytes(grid.d)]
    return np.concatenate(parts, axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks)
    return pack(grid, round_codes(blocks, grid))


def unpack(data: np.ndarray) -> tuple[SGrid, np.ndarray]:
    hmask = data[:, 0:32]
    high = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = unpack_crumbs(data[:, 32:96]) | (high.reshape(-1, 256) << 2)
    return SGrid(fp16_field(data, 108), unpack_scales(data[:, 96:108])), codes


def decode(data: np.ndarray) -> np.ndarray:
    grid, codes = unpack(data)
    q = (codes.astype(np.int8) - np.int8(4)).reshape(-1, 16, SUB).astype(F32)
    return (grid.scale()[..., None] * q).reshape(-1, 256)


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_row_q3_K_impl``: weights ``qw·sqrt(σ² + x²)`` (σ² = 2·mean(x²) of the super-block),
    weighted `make_qx_quants` per sub-block, then the 16 scales themselves by `make_qx_quants`
    (nmax 32) weighted by each sub-block's total weight."""
    n = blocks.shape[0]
    blocks = blocks.astype(F32, copy=False)
    weights = importance_weights(blocks, qw, mean_square(blocks, 2.0)).reshape(-1, SUB)
    total = _running_sum(np.ascontiguousarray(weights.T)).reshape(n, 16)
    scales, first = make_qx_quants(blocks.reshape(-1, SUB), 4, weights)
    d, sc = make_qx_quants(scales.reshape(n, 16), 32, total)
    grid = SGrid(fp16_round(d)[:, None], (sc - 32).astype(np.int8), first.reshape(n, 256))
    return pack(grid, round_codes(blocks, grid))
