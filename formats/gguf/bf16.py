"""BF16: the top 16 bits of a float32, rounded to nearest even (``ggml_compute_fp32_to_bf16``).

NaNs become quiet NaNs (top mantissa bit set) rather than being rounded into infinity.
Shapes: ``[N, 1]`` float32 <-> ``[N, 2]`` uint8, little-endian.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.BF16


def encode(blocks: np.ndarray) -> np.ndarray:
    bits = blocks.astype("<f4").view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet = (bits >> 16) | 64
    return np.where(nan, quiet, rounded).astype("<u2").reshape(-1, 1).view(np.uint8)


def decode(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data).view("<u2").astype(np.uint32) << 16
    return bits.view(np.float32)
