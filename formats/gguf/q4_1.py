"""Q4_1: blocks of 32 weights, float16 scale and minimum, 4-bit codes (5.0 bpw).

Layout (``block_q4_1``): ``d`` (f16), ``m`` (f16), ``qs[16]`` (Q4_0's nibble order); ``x = d·q + m``.
Encoding follows ``quantize_row_q4_1_ref``: ``d = (max − min)/15``, ``q = min(15, trunc((x − min)·(1/d)
+ 0.5))``. Shapes: blocks ``[N, 32]`` float32 <-> ``[N, 20]`` uint8.
"""

from __future__ import annotations

import numpy as np
import torch

from compress.formats.gguf._common import (
    F32, as_torch, fp16_bytes, fp16_field, importance_weights, nibbles, row_max, row_min, safe_reciprocal,
)
from compress.formats.gguf.solvers import make_qkx2_quants
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q4_1
DIRECT_ROUNDING = True  # each block rounded at once: no search over candidate scales (codecs.rounds_directly)
CODES = (0, 15)  # the weight is d·code + m


def fit_grid(blocks: np.ndarray, nmax: int = 15) -> tuple[np.ndarray, np.ndarray]:
    """Per-block (d, min) before float16 storage, each ``[N, 1]`` (``nmax`` 15; Q5_1 shares this with 31)."""
    lo = row_min(blocks)
    return ((row_max(blocks) - lo) / F32(nmax)).astype(F32), lo


def round_codes(blocks: np.ndarray, d: np.ndarray, lo: np.ndarray, nmax: int = 15) -> np.ndarray:
    shifted = as_torch(blocks) - torch.from_numpy(np.ascontiguousarray(lo, dtype=F32))
    # the C cast truncates; floor agrees wherever the clamp to 0 leaves the value (faster: see q4_0.round_codes)
    return shifted.mul_(torch.from_numpy(safe_reciprocal(d))).add_(F32(0.5)).floor_().clamp_(0, nmax).to(torch.uint8).numpy()


def weighted_fit(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray, nmax: int = 15):
    """((``d``, ``m``), codes) of ``quantize_row_q4_1_impl`` (Q5_1: nmax 31): weights ``qw·sqrt(σ² + x²)``
    (σ² = row mean of x²), then ``make_qkx3_quants`` (36 trial scales, weighted least squares)."""
    blocks = blocks.astype(F32, copy=False)
    w = importance_weights(blocks, qw, row_sigma2)
    d, the_min, q = make_qkx2_quants(blocks, w, nmax, -0.9, 0.05, 36, use_mad=False)
    return (d, -the_min), q


def pack(grid: tuple[np.ndarray, np.ndarray], codes: np.ndarray) -> np.ndarray:
    d, m = grid
    return np.concatenate([fp16_bytes(d), fp16_bytes(m), nibbles(codes[:, :16], codes[:, 16:])], axis=1)


def unpack(data: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """((stored ``d``, ``m``) each ``[N, 1]``, codes ``[N, 32]``)."""
    qs = data[:, 4:20]
    return (fp16_field(data, 0), fp16_field(data, 2)), np.concatenate([qs & 15, qs >> 4], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    d, lo = fit_grid(blocks)
    return pack((d, lo), round_codes(blocks, d, lo))


def decode(data: np.ndarray) -> np.ndarray:
    (d, m), q = unpack(data)
    return d * q.astype(F32) + m


def affine(grid: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Decodes of codes 0 and 1 per block ``[N, 1]``, by decode's own operations (`grids.stored`'s step and offset)."""
    d, m = grid
    return d * F32(0) + m, d * F32(1) + m


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray) -> np.ndarray:
    """`weighted_fit`; its codes are stored as they are."""
    return pack(*weighted_fit(blocks, qw, row_sigma2))
