"""IQ3_XXS: super-blocks of 256 weights in 8 blocks of 32, magnitudes from a 256-point grid in 4-D, signs of each 8
with even parity (3.0625 bpw).

Layout (``block_iq3_xxs``, ggml ``ggml-common.h``): ``d`` (f16), ``qs[64]`` (each group of 4's grid index), then
per block of 32 a little-endian uint32: bits 7k..7k+6 the signs of its group of 8 number k (bit i: element
8k + i is negative; the 8th sign is the parity of the 7, ggml's ``ksigns_iq2xs``), bits 28..31 the 4-bit scale.
``x = d·(0.5 + sc)·0.5·GRID[index][i]·(±1)``, ``GRID`` gguf-py's ``IQ3_XXS.grid`` (4·(2l + 1), 62 for l = 7).

Encoding follows ggml's ``quantize_row_iq3_xxs_impl(256)``: IQ3_S's search (`iq3_s.block_fit`) on the 256-point
grid with neighbour lists of the 2 smallest distances and 31 trial scales (t in −15..15), re-snapping only the
off-grid groups at the fitted scale; a block whose largest value is below 1e-8 is left empty. Signs are fixed first: a group of 8 with an odd number of negatives flips its
element of least ``weight·x²`` (the first such), which then enters the fit with a negated magnitude. A block
whose fitted scale comes out negative flips all its signs. ``d = max/31`` is stored ×1.0125, block scales
``round((s/d − 1)/2)``; a super-block whose scales are all 0 is all zero bytes. Shapes: ``[N, 256]`` <->
``[N, 98]`` uint8. GPTQ (`compress.quantizers.gguf_gptq`) writes its own points and parity-fixed signs on `fit_grid`'s grid.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field
from compress.formats.gguf.iq3_s import SUB, Tables, block_fit, tables
from compress.formats.gguf.lattice import HalfStepGrid, decoded, parity_negative, parity_signs, super_blocks
from compress.formats.gguf.iq4_nl import error_weights
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.IQ3_XXS
TINY = 1e-8  # ggml's GROUP_MAX_EPS_IQ3_XXS
SIGN_PARITY = 8  # signs come in groups of 8 with an even number of negatives


@cache
def grid_values() -> np.ndarray:
    """gguf-py's ``IQ3_XXS.grid``: the 256 points' decoded values ``[256, 4]`` (4, 12, ..., 52, 62)."""
    from gguf.quants import IQ3_XXS

    IQ3_XXS.init_grid()
    return np.asarray(IQ3_XXS.grid, dtype=np.uint8).reshape(256, 4)


def grid_tables() -> Tables:
    """ggml's ``iq3xs_init_impl(256)``: levels ``value // 8`` (values 4·(2l + 1), 62 for 7), 2 neighbour distances."""
    levels = grid_values().astype(np.int64) // 8
    return tables(tuple(int(c) for c in (levels << (3 * np.arange(4))).sum(axis=1)), 2)


def fit(blocks: np.ndarray, qw: np.ndarray | None = None) -> tuple[HalfStepGrid, np.ndarray, np.ndarray]:
    """(grid, points ``[N, 64]``, negative ``[N, 256]``) of ggml's encoder; with ``qw`` its imatrix fit."""
    x = blocks.astype(F32, copy=False)
    w = error_weights(x, qw)
    negative, xval = parity_signs(x, w)
    scales, points = block_fit(xval.reshape(-1, SUB), w.reshape(-1, SUB), grid_tables(), steps=15, tiny=TINY,
                               resnap_all=False)
    return super_blocks(scales, points, negative, 1.0125, 0.5)


def fit_grid(blocks: np.ndarray, qw: np.ndarray | None = None) -> HalfStepGrid:
    """The grid of `fit`, for points and signs chosen elsewhere (GPTQ)."""
    return fit(blocks, qw)[0]


def codebook() -> np.ndarray:
    """The 256 grid points' decoded magnitudes ``[256, 4]`` float32 (4, 12, ..., 52, 62)."""
    return grid_values().astype(F32)


def pack(grid: HalfStepGrid, points: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Bytes of ``[N, 64]`` grid points and ``[N, 256]`` signs (each 8 with even parity) on ``grid``."""
    d, sc = grid.d, grid.sc.astype(np.uint32)
    n = points.shape[0]
    bits = negative.reshape(n, 8, 4, 8)[..., :7].astype(np.uint32) << np.arange(7, dtype=np.uint32)
    words = (bits.sum(axis=3) << (7 * np.arange(4, dtype=np.uint32))).sum(axis=2, dtype=np.uint32) | (sc << 28)
    words = np.where((d > 0), words, 0).astype("<u4")
    return np.concatenate([fp16_bytes(d), points.astype(np.uint8), words.view(np.uint8).reshape(n, 32)], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    return pack(*fit(blocks))


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_iq3_xxs`` with an importance matrix (σ² is the super-block's, not the row's)."""
    return pack(*fit(blocks, qw))


def decode(data: np.ndarray) -> np.ndarray:
    n = data.shape[0]
    words = np.ascontiguousarray(data[:, 66:98]).view("<u4").astype(np.uint32)  # [N, 8]
    negative = parity_negative((words[..., None] >> (7 * np.arange(4, dtype=np.uint32))) & 127)  # [N, 8, 4, 8]
    grid = HalfStepGrid(fp16_field(data, 0), words >> 28, 0.5)
    values = grid_values()[data[:, 2:66]].astype(F32).reshape(n, 8, SUB)
    return decoded(grid, values, negative.reshape(n, 8, SUB))
