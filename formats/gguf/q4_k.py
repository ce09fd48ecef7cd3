"""Q4_K: super-blocks of 256 weights in 8 sub-blocks of 32, 4-bit codes (4.5 bpw).

Layout (``block_q4_K``): ``d`` (f16), ``dmin`` (f16), ``scales[12]`` (8 six-bit scales and 8 six-bit
mins, `pack_k_scales`), ``qs[128]``: chunk c holds elements ``64c + l`` (low nibble of ``qs[32c + l]``)
and ``64c + 32 + l`` (high nibble). ``x = d·sc_j·q − dmin·m_j``.

Encoding follows ``quantize_row_q4_K_ref`` (``ggml-quants.c``): each sub-block gets an asymmetric
(scale, min) from ``make_qkx2_quants`` with weights ``rms(sub-block) + |x|``; the 8 scales and 8 mins
are then quantized to 6 bits against the super-block maxima, and the codes rounded on that final grid.
The grid (`fit_grid`) is separate from the rounding (`round_codes`) so error-feedback solvers can
reuse the grid. Shapes: blocks ``[N, 256]`` float32 <-> ``[N, 144]`` uint8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compress.formats.gguf._common import (
    F32, _running_sum, as_torch, fp16_bytes, fp16_field, fp16_round, importance_weights, mean_square, nearest_int, nibbles, pack_k_scales, unpack_k_scales,
)
from compress.formats.gguf.solvers import make_qkx2_quants, make_qp_quants
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q4_K
CODES = (0, 15)  # the weight is d·sc·code − dmin·m
SUB = 32


@dataclass(frozen=True)
class KGrid:
    """A super-block grid: float16 ``d``/``dmin`` ``[N, 1]`` and 6-bit ``sc``/``m`` ``[N, 8]``."""

    d: np.ndarray
    dmin: np.ndarray
    sc: np.ndarray
    m: np.ndarray
    # codes for sub-blocks whose step d·sc is 0 (any code decodes alike there; ggml keeps its
    # first-pass rounding, and so do we to write the same bytes) ``[N, 256]``, or None for 0
    fallback: np.ndarray | None = None

    def scale(self) -> np.ndarray:
        """Per sub-block step ``d·sc`` ``[N, 8]`` (as the decoder computes it)."""
        return self.d * self.sc.astype(F32)

    def offset(self) -> np.ndarray:
        """Per sub-block ``dmin·m`` ``[N, 8]``, subtracted after scaling."""
        return self.dmin * self.m.astype(F32)


def fit_sub_blocks(blocks: np.ndarray, nmax: int, rmin: float, nstep: int) -> KGrid:
    """Shared by Q4_K (nmax 15) and Q5_K (nmax 31): per-sub-block fit, then 6-bit scales and mins."""
    n = blocks.shape[0]
    x = blocks.reshape(-1, SUB).astype(F32, copy=False)
    av_x = np.sqrt(_running_sum(np.ascontiguousarray((x * x).T)) / F32(SUB))[:, None]
    scales, mins, first = make_qkx2_quants(x, av_x + np.abs(x), nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1, keepdims=True), F32(0))
    max_min = np.maximum(mins.max(axis=1, keepdims=True), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    sc = np.clip(nearest_int(inv_scale * scales), 0, 63).astype(np.uint8)
    m = np.clip(nearest_int(inv_min * mins), 0, 63).astype(np.uint8)
    return KGrid(fp16_round(max_scale / F32(63)), fp16_round(max_min / F32(63)), sc, m, first.reshape(n, 256))


def fit_grid(blocks: np.ndarray) -> KGrid:
    return fit_sub_blocks(blocks, nmax=15, rmin=-1.0, nstep=20)


def round_codes(blocks: np.ndarray, grid: KGrid, nmax: int = 15) -> np.ndarray:
    """Codes in [0, nmax] ``[N, 256]``: ``round((x + dmin·m)/(d·sc))``; 0 where ``d·sc`` is 0. Shared by
    Q5_K (nmax 31) and Q2_K (nmax 3, 16 sub-blocks: the grid's scales say how many)."""
    n, subs = blocks.shape[0], grid.sc.shape[1]
    step = grid.scale()[..., None]
    dead = step == 0
    x = as_torch(blocks).view(n, subs, -1) + torch.from_numpy(grid.offset()[..., None])
    codes = x.div_(torch.from_numpy(np.where(dead, F32(1), step))).round_().clamp_(0, nmax).to(torch.uint8).numpy()
    if dead.any():
        codes = np.where(dead, 0 if grid.fallback is None else grid.fallback.reshape(codes.shape), codes)
    return codes.reshape(n, 256).astype(np.uint8)


def pack(grid: KGrid, codes: np.ndarray) -> np.ndarray:
    q = codes.reshape(-1, 4, 2, 32)
    qs = nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    return np.concatenate([fp16_bytes(grid.d), fp16_bytes(grid.dmin), pack_k_scales(grid.sc, grid.m), qs], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks)
    return pack(grid, round_codes(blocks, grid))


def unpack(data: np.ndarray) -> tuple[KGrid, np.ndarray]:
    sc, m = unpack_k_scales(data[:, 4:16])
    qs = data[:, 16:144].reshape(-1, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    return KGrid(fp16_field(data, 0), fp16_field(data, 2), sc, m), codes


def decode(data: np.ndarray) -> np.ndarray:
    grid, codes = unpack(data)
    q = torch.from_numpy(codes.reshape(-1, 8, SUB)).to(torch.float32)
    return q.mul_(torch.from_numpy(grid.scale()[..., None])).sub_(torch.from_numpy(grid.offset()[..., None])).reshape(-1, 256).numpy()


def fit_sub_blocks_weighted(blocks: np.ndarray, qw: np.ndarray, nmax: int) -> KGrid:
    """With an importance matrix (``quantize_row_q4_K_impl`` / ``q5_K_impl``): error weights
    ``qw·sqrt(σ² + x²)`` with σ² = 2·mean(x²) over the super-block, ``make_qkx3_quants`` (36 trial
    scales) per sub-block, then the 6-bit scales and mins fitted by `make_qp_quants` weighted by each
    sub-block's total weight."""
    n = blocks.shape[0]
    blocks = blocks.astype(F32, copy=False)
    weights = importance_weights(blocks, qw, mean_square(blocks, 2.0)).reshape(-1, SUB)
    total = _running_sum(np.ascontiguousarray(weights.T)).reshape(n, 8)
    scales, mins, first = make_qkx2_quants(blocks.reshape(-1, SUB), weights, nmax, -0.9, 0.05, 36, use_mad=False)
    d, sc = make_qp_quants(scales.reshape(n, 8), 63, total)
    dmin, m = make_qp_quants(mins.reshape(n, 8), 63, total)
    grid_sc, grid_m = np.clip(sc, 0, 63).astype(np.uint8), np.clip(m, 0, 63).astype(np.uint8)
    return KGrid(fp16_round(d)[:, None], fp16_round(dmin)[:, None], grid_sc, grid_m, first.reshape(n, 256))


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    grid = fit_sub_blocks_weighted(blocks, qw, 15)
    return pack(grid, round_codes(blocks, grid))
