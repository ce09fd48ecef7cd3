"""Q2_K: super-blocks of 256 weights in 16 sub-blocks of 16, 2-bit codes (2.625 bpw).

Layout (``block_q2_K``): ``scales[16]`` (low nibble: 4-bit scale, high nibble: 4-bit min, one byte per
sub-block), ``qs[64]``, ``d`` (f16), ``dmin`` (f16). The code of element ``128h + 32s + l`` is
``(qs[32h + l] >> 2s) & 3``; ``x = d·sc_j·q − dmin·m_j``.

Encoding follows ``quantize_row_q2_K_ref``: ``make_qkx2_quants(nmax=3, rmin=−0.5, nstep=15)`` with
weights ``|x|`` and absolute (not squared) error per sub-block, then 4-bit scales and mins against the
super-block maxima, then the codes on that grid. Shapes: blocks ``[N, 256]`` float32 <-> ``[N, 84]``.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf._common import (
    F32, _running_sum, fp16_bytes, fp16_field, fp16_round, importance_weights, mean_square, nearest_int,
)
from compress.formats.gguf.solvers import make_qkx2_quants, make_qp_quants
from compress.formats.gguf import q4_k
from compress.formats.gguf.q4_k import KGrid
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q2_K
CODES = (0, 3)  # the weight is d·sc·code − dmin·m
SUB = 16


def _quantize_4bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[N, 16]`` non-negative floats -> (4-bit ints, float16 super-scale ``[N, 1]``)."""
    top = np.maximum(values.max(axis=1, keepdims=True), F32(0))
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, F32(15) / top, F32(0))
    ints = np.clip(nearest_int(inv * values), 0, 15).astype(np.uint8)
    return ints, fp16_round(top / F32(15))


def fit_grid(blocks: np.ndarray) -> KGrid:
    n = blocks.shape[0]
    x = blocks.reshape(-1, SUB).astype(F32, copy=False)
    scales, mins, first = make_qkx2_quants(x, np.abs(x), 3, -0.5, 0.1, 15, use_mad=True)
    sc, d = _quantize_4bit(scales.reshape(n, 16))
    m, dmin = _quantize_4bit(mins.reshape(n, 16))
    return KGrid(d, dmin, sc, m, first.reshape(n, 256))


def round_codes(blocks: np.ndarray, grid: KGrid) -> np.ndarray:
    return q4_k.round_codes(blocks, grid, 3)


def pack_crumbs(codes: np.ndarray) -> np.ndarray:
    """2-bit codes ``[N, 256]`` -> ``[N, 64]``: element ``128h + 32s + l`` at bits 2s of byte ``32h + l``."""
    q = codes.reshape(-1, 2, 4, 32).astype(np.uint8)
    shifts = (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None]
    return (q << shifts).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def unpack_crumbs(qs: np.ndarray) -> np.ndarray:
    shifts = (np.arange(4, dtype=np.uint8) * 2)[None, None, :, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def pack(grid: KGrid, codes: np.ndarray) -> np.ndarray:
    scales = (grid.sc & 15) | (grid.m << 4)
    return np.concatenate([scales, pack_crumbs(codes), fp16_bytes(grid.d), fp16_bytes(grid.dmin)], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks)
    return pack(grid, round_codes(blocks, grid))


def unpack(data: np.ndarray) -> tuple[KGrid, np.ndarray]:
    scales = data[:, 0:16]
    grid = KGrid(fp16_field(data, 80), fp16_field(data, 82), scales & 15, scales >> 4)
    return grid, unpack_crumbs(data[:, 16:80])


def decode(data: np.ndarray) -> np.ndarray:
    grid, codes = unpack(data)
    q = codes.reshape(-1, 16, SUB).astype(F32)
    return (grid.scale()[..., None] * q - grid.offset()[..., None]).reshape(-1, 256)


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_row_q2_K_impl``: weights ``qw·sqrt(σ² + x²)`` (σ² = mean(x²) of the super-block),
    ``make_qkx3_quants`` per sub-block, 4-bit scales and mins by weighted `make_qp_quants`."""
    n = blocks.shape[0]
    blocks = blocks.astype(F32, copy=False)
    weights = importance_weights(blocks, qw, mean_square(blocks, 1.0)).reshape(-1, SUB)
    total = _running_sum(np.ascontiguousarray(weights.T)).reshape(n, 16)
    scales, mins, first = make_qkx2_quants(blocks.reshape(-1, SUB), weights, 3, -0.9, 0.05, 36, use_mad=False)
    d, sc = make_qp_quants(scales.reshape(n, 16), 15, total)
    dmin, m = make_qp_quants(mins.reshape(n, 16), 15, total)
    grid = KGrid(fp16_round(d)[:, None], fp16_round(dmin)[:, None], np.clip(sc, 0, 15).astype(np.uint8),
                 np.clip(m, 0, 15).astype(np.uint8), first.reshape(n, 256))
    return pack(grid, round_codes(blocks, grid))
