"""A GGUF block type seen as a per-weight affine grid, for solvers that choose the codes themselves.

Every quantized block type stores, per block of B weights, a grid (scales, and mins or an implicit zero)
and integer codes in the codec's ``CODES = (lo, hi)``, and its decoder is affine in the code:
``x = step·q − offset`` with ``step`` and ``offset`` per weight (Q4_K: ``d·sc_j`` and ``dmin·m_j`` of the
weight's sub-block; Q3_K: ``d·sc_j`` and ``4·d·sc_j``; Q8_0: ``d`` and 0). `fit` picks the grids with the
codec's own encoder (ggml's reference fit, or its importance-weighted fit) and reads them back from the
bytes, so they are exactly what the file stores; ``step``/``offset`` are read off the decoder at codes 0
and 1, so no type's algebra is repeated here. `pack` writes those grids with codes chosen elsewhere
(GPTQ's error-feedback rounding, `compress.quantizers.gguf_gptq`).

Shapes: blocks ``[N, B]`` float32; ``step``/``offset`` ``[N, B]``; codes ``[N, B]`` integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from compress.formats.gguf.codecs import CODECS
from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType


@dataclass(frozen=True)
class BlockGrid:
    kind: GGMLType
    grid: Any  # the codec's own grid object, as unpacked from the bytes
    step: np.ndarray  # [N, B]: the weight moves by this per code
    offset: np.ndarray  # [N, B]: subtracted; code q decodes to step·q − offset
    lo: int
    hi: int

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Nearest codes for ``x [N, B]`` on this grid (lo where a step is 0: every code decodes alike)."""
        dead = self.step == 0
        q = np.rint((x + self.offset) / np.where(dead, 1, self.step))
        return np.where(dead, self.lo, np.clip(q, self.lo, self.hi)).astype(np.int32)


def is_block_quantized(kind: GGMLType) -> bool:
    """True for the types with codes and grids (not F32/F16/BF16)."""
    return hasattr(CODECS.get(kind), "CODES")


def fit(kind: GGMLType, blocks: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None) -> BlockGrid:
    """The grid ``kind``'s encoder chooses for ``blocks [N, B]``; with ``importance [N, B]`` (and, for
    the legacy types, each block's row mean square ``row_sigma2 [N, 1]``) its importance-weighted fit."""
    codec = CODECS[kind]
    blocks = np.ascontiguousarray(blocks, dtype=np.float32)
    if importance is not None and hasattr(codec, "encode_weighted"):
        if row_sigma2 is None:
            row_sigma2 = np.mean(blocks * blocks, axis=1, keepdims=True, dtype=np.float32)
        data = codec.encode_weighted(blocks, np.ascontiguousarray(importance, dtype=np.float32), row_sigma2)
    else:
        data = codec.encode(blocks)
    grid, _ = codec.unpack(data)
    lo, hi = codec.CODES
    zeros = np.zeros(blocks.shape, dtype=np.int8 if lo < 0 else np.uint8)
    at_zero = codec.decode(codec.pack(grid, zeros))
    at_one = codec.decode(codec.pack(grid, zeros + 1))
    return BlockGrid(kind, grid, at_one - at_zero, -at_zero, lo, hi)


def pack(grid: BlockGrid, codes: np.ndarray) -> np.ndarray:
    """``[N, B]`` codes on ``grid`` -> ``[N, type_size]`` uint8 blocks."""
    if codes.min(initial=grid.lo) < grid.lo or codes.max(initial=grid.hi) > grid.hi:
        raise ValueError(f"codes outside {grid.kind.name}'s range [{grid.lo}, {grid.hi}]")
    return CODECS[grid.kind].pack(grid.grid, codes.astype(np.int8 if grid.lo < 0 else np.uint8))


def block_size(kind: GGMLType) -> int:
    return BLOCK_SIZES[kind][0]
