"""Q5_0: blocks of 32 weights, float16 scale, 5-bit codes with an implicit zero of 16 (5.5 bpw).

Layout (``block_q5_0``): ``d`` (f16), ``qh`` (u32 little-endian; bit j is the 5th bit of element j),
``qs[16]`` (low nibbles in Q4_0's order); ``x = d·(q − 16)``. Encoding follows
``quantize_row_q5_0_ref``: ``d = m/−16`` (m the signed largest-magnitude entry),
``q = min(31, trunc(x·(1/d) + 16.5))``. Shapes: blocks ``[N, 32]`` float32 <-> ``[N, 22]`` uint8.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, nibbles
from compress.formats.gguf import q4_0
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q5_0
DIRECT_ROUNDING = True  # each block rounded at once: no search over candidate scales (codecs.rounds_directly)
CODES = (0, 31)  # the weight is d·(code − 16)


def fit_grid(blocks: np.ndarray) -> np.ndarray:
    return q4_0.fit_grid(blocks, 16)


def round_codes(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    return q4_0.round_codes(blocks, d, 16)


def pack_high_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 codes -> 4 bytes, element j at bit j (little-endian u32)."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=1, bitorder="little")


def pack(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    q = codes.astype(np.uint8)
    return np.concatenate([fp16_bytes(d), pack_high_bits(q), nibbles(q[:, :16], q[:, 16:])], axis=1)


def unpack(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stored ``d`` ``[N, 1]``, codes ``[N, 32]``)."""
    qs = data[:, 6:22]
    return fp16_field(data, 0), np.concatenate([qs & 15, qs >> 4], axis=1) | (unpack_high_bits(data[:, 2:6]) << 4)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    d = fit_grid(blocks)
    return pack(d, round_codes(blocks, d))


def decode(data: np.ndarray) -> np.ndarray:
    d, q = unpack(data)
    return d * (q.astype(np.int8) - np.int8(16)).astype(F32)


def affine(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decodes of codes 0 and 1 per block ``[N, 1]``, by decode's own operations (`grids.stored`'s step and offset)."""
    return d * F32(-16), d * F32(-15)


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_0_impl``: as Q4_0's with nmax 16."""
    return pack(*q4_0.weighted_fit(blocks, qw, row_sigma2, 16))
