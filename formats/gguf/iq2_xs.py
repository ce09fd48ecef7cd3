"""IQ2_XS: super-blocks of 256 weights in 16 blocks of 16, magnitudes from a 512-point grid in 8-D (2 bits a
coordinate), signs of each 8 with even parity (2.3125 bpw). Needs an importance matrix, as in ggml.

Layout (``block_iq2_xs``, ggml ``ggml-common.h``): ``d`` (f16), ``qs[32]`` little-endian uint16 (group of 8
number g: bits 0..8 its grid index, bits 9..15 the signs of its first 7 elements, the 8th the parity of
the 7, ggml's ``ksigns_iq2xs``), ``scales[8]`` (block j's 4-bit scale in nibble j mod 2 of byte j/2).
``x = d·(0.5 + sc)·0.25·GRID[index][i]·(±1)``, ``GRID`` gguf-py's ``IQ2_XS.grid`` (8, 25, 43 for levels 0..2).

Encoding follows ggml's ``quantize_row_iq2_xs_impl``: error weights ``qw·sqrt(σ² + x²)`` with σ² = mean(x²)
over the super-block; signs fixed first as IQ3_XXS does (`iq3_xxs.parity_signs`); per block of 16 IQ3_S's
search (`iq3_s.block_fit`) on this grid: levels 0..2 (values 1, 3, 5), 19 trial inverse scales
``(5 + 0.1·t)/max`` (t in −9..9), neighbour lists of the 2 smallest distances, only the off-grid groups
re-snapped at the fitted scale; a block whose largest value is below 1e-15 is empty (all-zero entries).
``d = max/31`` (no stretch), block scales ``round((s/d − 1)/2)``; a super-block whose scales are all 0 is
all zero bytes. Shapes: ``[N, 256]`` <-> ``[N, 74]`` uint8. GPTQ writes its own points and signs on `fit_grid`'s grid.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, importance_weights, mean_square
from compress.formats.gguf.iq3_s import Tables, block_fit, tables
from compress.formats.gguf.lattice import HalfStepGrid, decoded, parity_negative, parity_signs, super_blocks
from compress.formats.gguf.sizes import QK_K, GGMLType

KIND = GGMLType.IQ2_XS
NEEDS_IMPORTANCE = True  # ggml asserts on a missing importance matrix (``quantize_row_iq2_xs_impl``)
SUB = 16  # weights per block scale
SIGN_PARITY = 8  # signs come in groups of 8 with an even number of negatives
TINY = 1e-15  # ggml's GROUP_MAX_EPS
_LEVEL = {8: 0, 25: 1, 43: 2}


@cache
def grid_values() -> np.ndarray:
    """gguf-py's ``IQ2_XS.grid``: the 512 points' decoded values ``[512, 8]`` (8, 25, 43)."""
    from gguf.quants import IQ2_XS

    IQ2_XS.init_grid()
    return np.asarray(IQ2_XS.grid, dtype=np.float32).reshape(512, 8)


def level_codes(values: np.ndarray) -> tuple[int, ...]:
    """ggml's ``kgrid_2bit_*`` from a grid's decoded values ``[P, 8]`` (8, 25, 43 -> levels 0, 1, 2 in 2 bits each)."""
    levels = np.vectorize(_LEVEL.get)(values.astype(np.int64))
    return tuple(int(c) for c in (levels << (2 * np.arange(8))).sum(axis=1))


def grid_tables() -> Tables:
    """ggml's ``iq2xs_init_impl(IQ2_XS)``: ``kgrid_2bit_512``, neighbours at the 2 smallest distances."""
    return tables(level_codes(grid_values()), 2, group=8, bits=2, max_level=2)


def fit(blocks: np.ndarray, qw: np.ndarray) -> tuple[HalfStepGrid, np.ndarray, np.ndarray]:
    """(grid, points ``[N, 32]``, negative ``[N, 256]``) of ggml's importance-weighted encoder."""
    x = blocks.astype(F32, copy=False)
    w = importance_weights(x, qw.astype(F32, copy=False), mean_square(x))
    negative, xval = parity_signs(x, w)
    scales, points = block_fit(xval.reshape(-1, SUB), w.reshape(-1, SUB), grid_tables(), steps=9, tiny=TINY,
                               resnap_all=False, base=5, increment=0.1)
    return super_blocks(scales, points, negative, 1.0, 0.25)


def fit_grid(blocks: np.ndarray, qw: np.ndarray) -> HalfStepGrid:
    """The grid of `fit`, for points and signs chosen elsewhere (GPTQ)."""
    return fit(blocks, qw)[0]


def codebook() -> np.ndarray:
    """The 512 grid points' decoded magnitudes ``[512, 8]`` float32 (8, 25, 43)."""
    return grid_values()


def pack(grid: HalfStepGrid, points: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Bytes of ``[N, 32]`` grid points and ``[N, 256]`` signs (each 8 with even parity) on ``grid``."""
    d, sc = grid.d, grid.sc
    n = points.shape[0]
    signs = (negative.reshape(n, 32, 8)[..., :7].astype(np.uint16) << np.arange(7, dtype=np.uint16)).sum(axis=2, dtype=np.uint16)
    qs = (points.astype(np.uint16) | (signs << 9)).astype("<u2")
    scales = (sc[:, 0::2] | (sc[:, 1::2] << 4)).astype(np.uint8)
    return np.concatenate([fp16_bytes(d), qs.view(np.uint8).reshape(n, 64), scales], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    raise ValueError("IQ2_XS needs an importance matrix (ggml's encoder has no fit without one): pass an imatrix")


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_iq2_xs`` with an importance matrix (σ² is the super-block's, not the row's)."""
    return pack(*fit(blocks, qw))


def decode(data: np.ndarray) -> np.ndarray:
    n = data.shape[0]
    qs = np.ascontiguousarray(data[:, 2:66]).view("<u2").astype(np.uint32)  # [N, 32]
    raw = data[:, 66:74]
    grid = HalfStepGrid(fp16_field(data, 0), np.stack([raw & 15, raw >> 4], axis=2).reshape(n, QK_K // SUB), 0.25)
    values = grid_values()[qs & 511].reshape(n, QK_K // SUB, SUB)
    return decoded(grid, values, parity_negative(qs >> 9).reshape(n, QK_K // SUB, SUB))
