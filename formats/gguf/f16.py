"""F16 (IEEE half, round to nearest even) and F32: one element per "block".

Shapes: ``[N, 1]`` float32 <-> ``[N, 2]`` (F16) or ``[N, 4]`` (F32) uint8, little-endian.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.F16


def encode(blocks: np.ndarray) -> np.ndarray:
    return blocks.astype("<f2").reshape(-1, 1).view(np.uint8)


def decode(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).view("<f2").astype(np.float32)


def encode_f32(blocks: np.ndarray) -> np.ndarray:
    return blocks.astype("<f4").reshape(-1, 1).view(np.uint8)


def decode_f32(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).view("<f4").copy()
