"""Q4_0: blocks of 32 weights, one float16 scale and 4-bit codes with an implicit zero of 8 (4.5 bpw).

Layout (``block_q4_0``): ``d`` (f16), ``qs[16]``: element j is ``qs[j] & 15``, element j+16 is
``qs[j] >> 4``; ``x = d·(q − 8)``. Encoding follows ``quantize_row_q4_0_ref``: ``d = m/−8`` where m is
the signed entry of largest magnitude, ``q = min(15, trunc(x·(1/d) + 8.5))``.
Shapes: blocks ``[N, 32]`` float32 <-> ``[N, 18]`` uint8.
"""

from __future__ import annotations

import numpy as np
import torch

from compress.formats.gguf._common import (
    F32, as_torch, fp16_bytes, fp16_field, importance_weights, nibbles, safe_reciprocal, signed_absmax,
)
from compress.formats.gguf.solvers import make_qx_quants
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q4_0
DIRECT_ROUNDING = True  # each block rounded at once: no search over candidate scales (codecs.rounds_directly)
CODES = (0, 15)  # stored codes; the weight is d·(code − 8)


def fit_grid(blocks: np.ndarray, nmax: int = 8) -> np.ndarray:
    """Per-block scale ``d`` before float16 storage, ``[N, 1]`` (``nmax`` 8; Q5_0 shares this with 16)."""
    return (signed_absmax(blocks) / F32(-nmax)).astype(F32)


def round_codes(blocks: np.ndarray, d: np.ndarray, nmax: int = 8) -> np.ndarray:
    """Codes in [0, 2·nmax − 1] for a given per-block scale (ggml rounds with the unrounded d)."""
    scaled = as_torch(blocks) * torch.from_numpy(safe_reciprocal(d))
    # ggml's (int8_t) cast truncates; floor is the same wherever the clamp to 0 leaves the value (and runs ~7x
    # faster: torch's trunc is not vectorised on CPU)
    return scaled.add_(F32(nmax + 0.5)).floor_().clamp_(0, 2 * nmax - 1).to(torch.uint8).numpy()


def weighted_fit(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray, nmax: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(``d``, codes) of ``quantize_row_q4_0_impl`` (Q5_0: nmax 16): weights ``qw·sqrt(σ² + x²)`` with
    σ² = mean(x²) over the whole row (``row_sigma2`` ``[N, 1]``), a weighted `make_qx_quants` fit."""
    blocks = blocks.astype(F32, copy=False)
    return make_qx_quants(blocks, nmax, importance_weights(blocks, qw, row_sigma2))


def pack(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return np.concatenate([fp16_bytes(d), nibbles(codes[:, :16], codes[:, 16:])], axis=1)


def unpack(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stored ``d`` ``[N, 1]``, codes ``[N, 32]``)."""
    qs = data[:, 2:18]
    return fp16_field(data, 0), np.concatenate([qs & 15, qs >> 4], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    d = fit_grid(blocks)
    return pack(d, round_codes(blocks, d))


def decode(data: np.ndarray) -> np.ndarray:
    d, q = unpack(data)
    return d * (q.astype(np.int8) - np.int8(8)).astype(F32)


def affine(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decodes of codes 0 and 1 per block ``[N, 1]``, by decode's own operations (`grids.stored`'s step and offset)."""
    return d * F32(-8), d * F32(-7)


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray) -> np.ndarray:
    """`weighted_fit`; its codes are stored as they are."""
    return pack(*weighted_fit(blocks, qw, row_sigma2))
