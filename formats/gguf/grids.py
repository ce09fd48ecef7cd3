"""A GGUF block type seen as a per-weight grid, for solvers that choose the codes themselves.

Every quantized block type stores, per block of B weights, a grid (scales, and mins or an implicit zero)
and integer codes in the codec's ``CODES = (lo, hi)``, and its decoder is ``x = step·level(q) − offset``
with ``step`` and ``offset`` per weight. For the affine types the level is the code itself (Q4_K:
``step = d·sc_j``, ``offset = dmin·m_j``; Q3_K: ``d·sc_j`` and ``4·d·sc_j``; Q8_0: ``d`` and 0); the
non-uniform types (IQ4_NL, IQ4_XS) name their codebook ``LEVELS`` (the value of each code) and have no
offset: ``x = step·LEVELS[q]``. `fit` picks the grids with the codec's own encoder (ggml's reference fit,
or its importance-weighted fit) and reads them back from the bytes (`stored`, which reads any blocks' grids), so
they are exactly what the file stores; ``step``/``offset`` are read off the decoder (affine: at codes 0 and 1;
codebook: at the code whose level is 1), so no type's algebra is repeated here. `pack` writes those grids with codes chosen
elsewhere (GPTQ's error-feedback rounding, `compress.quantizers.gguf_gptq`).

The lattice types (IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S) code a group of 4 or 8 weights at once: `LatticeGrid` holds each
weight's step and the codec's ``codebook()`` of points (magnitudes, ``[P, group]``); a group decodes to
``step·point·(±1)``, each weight's sign free (IQ3_S, IQ2_S) or, in groups of ``parity``, with an even number of
negatives (IQ3_XXS, IQ2_XXS, IQ2_XS). `fit` returns one for them and `pack_lattice` writes chosen points.

Shapes: blocks ``[N, B]`` float32; ``step``/``offset`` ``[N, B]``; codes ``[N, B]`` integers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from compress.formats.gguf.codecs import CODECS, chunk_elements, in_chunks, plain_importance
from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType
from compress.quantizers.threads import one_thread


@dataclass(frozen=True)
class BlockGrid:
    kind: GGMLType
    grid: Any  # the codec's own grid object, as unpacked from the bytes
    step: np.ndarray  # [N, B]: the weight moves by this per code
    offset: np.ndarray  # [N, B]: subtracted; code q decodes to step·q − offset
    lo: int
    hi: int
    levels: np.ndarray | None = None  # codebook types: float32 value of each code lo..hi; None: the code

    def values(self, codes: np.ndarray) -> np.ndarray:
        """The weights ``codes [N, B]`` decode to on this grid."""
        level = codes if self.levels is None else self.levels[np.asarray(codes) - self.lo]
        return self.step * level - self.offset

    def codes(self, x: np.ndarray) -> np.ndarray:
        """Nearest codes for ``x [N, B]`` on this grid (lo where a step is 0: every code decodes alike;
        between two codebook levels a tie takes the upper, as ggml's ``best_index_int8``)."""
        dead = self.step == 0
        t = (x + self.offset) / np.where(dead, 1, self.step)
        if self.levels is None:
            q = np.clip(np.rint(t), self.lo, self.hi)
        else:
            q = self.lo + np.searchsorted(midpoints(self.levels), t, side="right")
        return np.where(dead, self.lo, q).astype(np.int32)


def midpoints(levels: np.ndarray) -> np.ndarray:
    """The decision boundaries of nearest-level rounding on a sorted codebook, ``[n_levels − 1]``."""
    return (levels[:-1] + levels[1:]) / 2


@dataclass(frozen=True)
class LatticeGrid:
    kind: GGMLType
    grid: Any  # the codec's own grid object
    step: np.ndarray  # [N, B]: each weight's scale (0: the block decodes to 0 whatever the point)
    points: np.ndarray  # [P, group] float32: the codebook's magnitudes
    parity: int = 0  # signs in groups of this many with an even number of negatives (IQ3_XXS, IQ2_XXS, IQ2_XS); 0: free

    @property
    def group(self) -> int:
        return self.points.shape[1]


def is_lattice(kind: GGMLType) -> bool:
    return hasattr(CODECS.get(kind), "codebook")


def has_codebook(kind: GGMLType) -> bool:
    """True for the types whose codes index a non-uniform codebook of levels (IQ4_NL, IQ4_XS)."""
    return getattr(CODECS.get(kind), "LEVELS", None) is not None


def is_block_quantized(kind: GGMLType) -> bool:
    """True for the types with codes and grids (not F32/F16/BF16)."""
    return hasattr(CODECS.get(kind), "CODES") or is_lattice(kind)


def fit(
    kind: GGMLType, blocks: np.ndarray, importance: np.ndarray | None = None, row_sigma2: np.ndarray | None = None
) -> BlockGrid | LatticeGrid:
    """The grid ``kind``'s encoder chooses for ``blocks [N, B]``; with ``importance [N, B]`` (and, for
    the legacy types, each block's row mean square ``row_sigma2 [N, 1]``) its importance-weighted fit."""
    codec = CODECS[kind]
    blocks = np.ascontiguousarray(blocks, dtype=np.float32)
    if is_lattice(kind):
        importance = plain_importance(kind, blocks.shape) if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
        parts: dict[int, Any] = {}  # each row is its own fit: parts of rows on the encoders' threads, joined in order

        def fit_part(part: slice) -> None:
            parts[part.start] = codec.fit_grid(blocks[part], None if importance is None else importance[part])

        in_chunks(blocks.shape[0], blocks.shape[1], fit_part, chunk_elements(kind, True))
        grid = _joined([parts[start] for start in sorted(parts)])
        step = np.repeat(grid.scale(), blocks.shape[1] // grid.scale().shape[1], axis=1)
        return LatticeGrid(kind, grid, step, codec.codebook(), getattr(codec, "SIGN_PARITY", 0))
    weighted = importance is not None and hasattr(codec, "encode_weighted")
    if weighted:
        if row_sigma2 is None:
            row_sigma2 = np.mean(blocks * blocks, axis=1, keepdims=True, dtype=np.float32)
        importance = np.ascontiguousarray(importance, dtype=np.float32)
    data = np.empty((blocks.shape[0], BLOCK_SIZES[kind][1]), dtype=np.uint8)

    def work(part: slice) -> None:
        data[part] = codec.encode_weighted(blocks[part], importance[part], row_sigma2[part]) if weighted else codec.encode(blocks[part])

    in_chunks(blocks.shape[0], blocks.shape[1], work, chunk_elements(kind, weighted))
    return stored(kind, data)


def stored(kind: GGMLType, data: np.ndarray) -> BlockGrid:
    """The grid that blocks ``data [N, type_size]`` (uint8, a non-lattice type's) are written on: `pack` with it and
    their own codes writes them again."""
    # the decodes on one thread: torch's threads would leave an OpenMP thread spinning on a core for a while after,
    # which the threads of GPTQ's next step (compress.quantizers.gguf_gptq) want
    with one_thread(torch.device("cpu")):
        return _affine_grid(kind, CODECS[kind].unpack(data)[0], (data.shape[0], block_size(kind)))


def _affine_grid(kind: GGMLType, grid: Any, shape: tuple[int, int]) -> BlockGrid:
    """The `BlockGrid` of the codec's ``grid`` for blocks of ``shape``: each weight's step and offset, decoded."""
    codec = CODECS[kind]
    lo, hi = codec.CODES
    affine = getattr(codec, "affine", None)
    if affine is not None:  # one scale (and minimum) per block: codes 0 and 1 decoded from it, not packed and decoded
        at_zero, at_one = affine(grid)
        width = shape[1] // at_zero.shape[1]
        return BlockGrid(kind, grid, np.repeat(at_one - at_zero, width, axis=1), np.repeat(-at_zero, width, axis=1), lo, hi)
    zeros = np.zeros(shape, dtype=np.int8 if lo < 0 else np.uint8)
    levels = getattr(codec, "LEVELS", None)
    if levels is not None:  # x = step·LEVELS[q]: the step is the decode of the code whose level is 1
        unit = lo + int(np.flatnonzero(levels == 1)[0])
        step = codec.decode(codec.pack(grid, zeros + unit))
        return BlockGrid(kind, grid, step, np.zeros_like(step), lo, hi, levels)
    at_zero = codec.decode(codec.pack(grid, zeros))
    at_one = codec.decode(codec.pack(grid, zeros + 1))
    return BlockGrid(kind, grid, at_one - at_zero, -at_zero, lo, hi)


def _joined(grids: list) -> Any:
    """One lattice grid (a dataclass of ``[N, ...]`` arrays and constants) from the grids of consecutive row parts."""
    first = grids[0]
    if len(grids) == 1:
        return first
    return replace(first, **{f.name: np.concatenate([getattr(g, f.name) for g in grids])
                             for f in fields(first) if isinstance(getattr(first, f.name), np.ndarray)})


def pack(grid: BlockGrid, codes: np.ndarray) -> np.ndarray:
    """``[N, B]`` codes on ``grid`` -> ``[N, type_size]`` uint8 blocks."""
    if codes.min(initial=grid.lo) < grid.lo or codes.max(initial=grid.hi) > grid.hi:
        raise ValueError(f"codes outside {grid.kind.name}'s range [{grid.lo}, {grid.hi}]")
    return CODECS[grid.kind].pack(grid.grid, codes.astype(np.int8 if grid.lo < 0 else np.uint8))


def pack_lattice(grid: LatticeGrid, points: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Point indices ``[N, B/group]`` and signs ``[N, B]`` on ``grid`` -> ``[N, type_size]`` uint8 blocks."""
    if points.min(initial=0) < 0 or points.max(initial=0) >= len(grid.points):
        raise ValueError(f"points outside {grid.kind.name}'s codebook of {len(grid.points)}")
    return CODECS[grid.kind].pack(grid.grid, points, negative)


def block_size(kind: GGMLType) -> int:
    return BLOCK_SIZES[kind][0]
