"""Q5_1: blocks of 32 weights, float16 scale and minimum, 5-bit codes (6.0 bpw).

Layout (``block_q5_1``): ``d`` (f16), ``m`` (f16), ``qh[4]`` (bit j = 5th bit of element j),
``qs[16]``; ``x = d·q + m``. Encoding follows ``quantize_row_q5_1_ref``: ``d = (max − min)/31``,
``q = trunc((x − min)·(1/d) + 0.5)``. Shapes: blocks ``[N, 32]`` float32 <-> ``[N, 24]`` uint8.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, nibbles
from compress.formats.gguf import q4_1
from compress.formats.gguf.q5_0 import pack_high_bits, unpack_high_bits
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q5_1
DIRECT_ROUNDING = True  # each block rounded at once: no search over candidate scales (codecs.rounds_directly)
CODES = (0, 31)  # the weight is d·code + m


def fit_grid(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return q4_1.fit_grid(blocks, 31)


def round_codes(blocks: np.ndarray, d: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return q4_1.round_codes(blocks, d, lo, 31)


def pack(grid: tuple[np.ndarray, np.ndarray], codes: np.ndarray) -> np.ndarray:
    d, m = grid
    q = codes.astype(np.uint8)
    return np.concatenate([fp16_bytes(d), fp16_bytes(m), pack_high_bits(q), nibbles(q[:, :16], q[:, 16:])], axis=1)


def unpack(data: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """((stored ``d``, ``m``) each ``[N, 1]``, codes ``[N, 32]``)."""
    qs = data[:, 8:24]
    q = np.concatenate([qs & 15, qs >> 4], axis=1) | (unpack_high_bits(data[:, 4:8]) << 4)
    return (fp16_field(data, 0), fp16_field(data, 2)), q


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
    """``quantize_row_q5_1_impl``: as Q4_1's with nmax 31."""
    return pack(*q4_1.weighted_fit(blocks, qw, row_sigma2, 31))
