"""What the lattice i-quants IQ3_XXS, IQ2_XXS, IQ2_XS and IQ2_S share besides the grid search
(`iq3_s.block_fit`): signs of each 8 with even parity, the super-block's scales (ggml's common tail of
``quantize_row_iq{3_xxs,2_xxs,2_xs,2_s}_impl``), the grid object GPTQ reads, and the decoder's last step.

Each stores per super-block of 256 a float16 ``d`` and per block a 4-bit scale ``sc``; a block decodes as
``d·(0.5 + sc)·factor·value·(±1)`` (factor 0.5 for IQ3_XXS, 0.25 for the IQ2 types). Shapes: ``[N, 256]`` weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compress.formats.gguf._common import F32, fp16_round, nearest_int, safe_reciprocal
from compress.formats.gguf.sizes import QK_K


@dataclass(frozen=True)
class HalfStepGrid:
    """``d`` ``[N, 1]`` before the float16 store (the type's stretch included), 4-bit block scales ``sc``
    ``[N, blocks]`` and the type's ``factor``."""

    d: np.ndarray
    sc: np.ndarray
    factor: float

    def scale(self) -> np.ndarray:
        """Per block ``d·(0.5 + sc)·factor`` ``[N, blocks]``, as the decoder computes it (with the stored d)."""
        return (fp16_round(self.d) * (F32(0.5) + self.sc.astype(F32))) * F32(self.factor)


def parity_signs(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(negative ``[N, 256]`` with even parity per 8, the magnitudes to fit ``[N, 256]``): a group of 8 with an odd
    number of negatives flips its element of least ``w·x²`` (the first such), which is then fitted negated."""
    negative = ~(x >= 0)
    groups = negative.reshape(-1, 8)
    odd = groups.sum(axis=1) % 2 == 1
    least = np.argmin((w * x * x).reshape(-1, 8), axis=1)  # the first minimum, as ggml's strict <
    flip = np.zeros_like(groups)
    flip[np.flatnonzero(odd), least[odd]] = True
    flip = flip.reshape(x.shape)
    xval = np.where(x >= 0, x, -x).astype(F32)
    return negative ^ flip, np.where(flip, -xval, xval)


def parity_negative(low7: np.ndarray) -> np.ndarray:
    """The 8 signs ``[..., 8]`` (True: negative) of stored 7-bit sign fields: the 8th is their parity (``ksigns_iq2xs``)."""
    parity = np.zeros_like(low7)
    for i in range(7):
        parity ^= (low7 >> i) & 1
    return (((low7 | (parity << 7))[..., None] >> np.arange(8, dtype=low7.dtype)) & 1).astype(bool)


def super_blocks(scales: np.ndarray, points: np.ndarray, negative: np.ndarray, stretch: float,
                 factor: float) -> tuple[HalfStepGrid, np.ndarray, np.ndarray]:
    """ggml's tail from `block_fit`'s per-block scales ``[N·blocks]`` (a negative one flips its block's signs),
    points ``[N·blocks, k]`` and negative ``[N, 256]``: ``d = max/31`` (stored ×``stretch``), block scales
    ``round((s/d − 1)/2)`` in 0..15 (all 0 in an all-zero super-block), and an empty block's points and signs
    zero, as ggml leaves them. Returns (grid, points ``[N, 256/group]``, negative)."""
    n = negative.shape[0]
    sub = QK_K * n // scales.size
    negative = negative ^ (scales < 0).reshape(n, -1).repeat(sub, axis=1)  # never seen; ggml guards it so
    scales = np.abs(scales).reshape(n, -1)
    top = scales.max(axis=1, initial=F32(0))
    d = (top / F32(31)).astype(F32)
    sc = np.clip(nearest_int(F32(0.5) * (safe_reciprocal(d)[:, None] * scales - F32(1))), 0, 15).astype(np.uint8)
    empty = scales == 0
    points = points.reshape(n, -1)
    points = np.where(np.repeat(empty, points.shape[1] // scales.shape[1], axis=1), 0, points)
    grid = HalfStepGrid((d * F32(stretch))[:, None], np.where(top[:, None] > 0, sc, 0).astype(np.uint8), factor)
    return grid, points, negative & ~np.repeat(empty, sub, axis=1)


def decoded(grid: HalfStepGrid, values: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """``(scale·value)·(±1)`` ``[N, 256]`` from the grid read back, values and signs ``[N, blocks, sub]``."""
    signed = np.where(negative, F32(-1), F32(1))
    return ((grid.scale()[..., None] * values) * signed).reshape(values.shape[0], QK_K)
