"""Q8_0: blocks of 32 weights, one float16 scale and 32 signed bytes (8.5 bits per weight).

Layout (``ggml-common.h`` ``block_q8_0``): ``d`` (f16), ``qs`` int8[32]; ``x = d·q``. Encoding follows
``quantize_row_q8_0_ref``: ``d = max|x|/127``, ``q = roundf(x/d)`` (half away from zero), computed
as ``x·(1/d)`` in float32. Shapes: blocks ``[N, 32]`` float32 <-> ``[N, 34]`` uint8. The encoder's
elementwise work runs in torch (several times numpy's speed at one thread for the row maxima).
"""

from __future__ import annotations

import numpy as np
import torch

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, round_half_away_, safe_reciprocal
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.Q8_0
DIRECT_ROUNDING = True  # each block rounded at once: no search over candidate scales (codecs.rounds_directly)
CODES = (-128, 127)  # signed bytes; the weight is d·code


def fit_grid(blocks: np.ndarray) -> np.ndarray:
    """Per-block scale ``d`` before float16 storage, ``[N, 1]``."""
    return (torch.from_numpy(np.ascontiguousarray(blocks, dtype=F32)).abs().amax(1, keepdim=True) / 127).numpy()


def round_codes(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    scaled = torch.from_numpy(np.ascontiguousarray(blocks, dtype=F32)) * torch.from_numpy(safe_reciprocal(d))
    return round_half_away_(scaled).to(torch.int8).numpy()


def pack(d: np.ndarray, codes: np.ndarray) -> np.ndarray:
    return np.concatenate([fp16_bytes(d), codes.astype(np.int8).view(np.uint8)], axis=1)


def unpack(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stored ``d`` ``[N, 1]``, signed codes ``[N, 32]``)."""
    return fp16_field(data, 0), np.ascontiguousarray(data[:, 2:]).view(np.int8)


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    d = fit_grid(blocks)
    return pack(d, round_codes(blocks, d))


def decode(data: np.ndarray) -> np.ndarray:
    d, q = unpack(data)
    return q.astype(F32) * d


def affine(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decodes of codes 0 and 1 per block ``[N, 1]``, by decode's own operations (`grids.stored`'s step and offset)."""
    return F32(0) * d, F32(1) * d
