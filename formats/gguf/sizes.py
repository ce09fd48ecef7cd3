"""GGML tensor types and their block geometry (the one size table every codec shares).

Ids and sizes are ggml's (``ggml/include/ggml.h`` ``enum ggml_type``; ``ggml/src/ggml-common.h`` block
structs). A tensor row of ``n`` elements of a block type is stored as ``n / block_size`` blocks of
``type_size`` bytes each; ``n`` must be a multiple of ``block_size`` (32 for the legacy quants and
IQ4_NL, 256 for the k-quants and IQ4_XS, ``QK_K``).
"""

from __future__ import annotations

from enum import IntEnum


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    BF16 = 30


QK_K = 256

# type -> (elements per block, bytes per block)
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    GGMLType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    GGMLType.IQ2_XXS: (QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: (QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: (QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (QK_K, 2 + QK_K // 4 + QK_K // 32 + QK_K // 8 + QK_K // 64),
    GGMLType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
    GGMLType.IQ2_S: (QK_K, 2 + QK_K // 4 + QK_K // 32 + QK_K // 32),
}


def bits_per_weight(kind: GGMLType) -> float:
    block, size = BLOCK_SIZES[kind]
    return 8.0 * size / block


def row_bytes(kind: GGMLType, n: int) -> int:
    """Bytes of one stored row of ``n`` elements (``n`` a multiple of the block size)."""
    block, size = BLOCK_SIZES[kind]
    return n // block * size


# type -> byte offsets, within each block, of its float16 scale ``d`` and of its float16 min (``dmin``; Q4_1/Q5_1's
# ``m``), or None where the type stores no min (ggml-common.h's block structs). Every weight of a block decodes
# linearly in these two: ``x = d·(codes and sub-block scales) + (min field)·(sub-block mins or 1)``.
SCALE_FIELDS: dict[GGMLType, tuple[int, int | None]] = {
    GGMLType.Q4_0: (0, None),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0, None),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0, None),
    GGMLType.Q2_K: (QK_K // 16 + QK_K // 4, QK_K // 16 + QK_K // 4 + 2),
    GGMLType.Q3_K: (QK_K // 8 + QK_K // 4 + 12, None),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (QK_K // 2 + QK_K // 4 + QK_K // 16, None),
    GGMLType.IQ2_XXS: (0, None),
    GGMLType.IQ2_XS: (0, None),
    GGMLType.IQ3_XXS: (0, None),
    GGMLType.IQ4_NL: (0, None),
    GGMLType.IQ3_S: (0, None),
    GGMLType.IQ2_S: (0, None),
    GGMLType.IQ4_XS: (0, None),
}
