"""IQ2_S: super-blocks of 256 weights in 16 blocks of 16, magnitudes from a 1024-point grid in 8-D (2 bits a
coordinate), free signs (2.5625 bpw).

Layout (``block_iq2_s``, ggml ``ggml-common.h``): ``d`` (f16), ``qs[64]`` (bytes 0..31: the low 8 bits of each
group of 8's grid index; bytes 32..63: its signs, bit i: element i negative), ``qh[8]`` (bits 2(g mod 4).. of
``qh[g // 4]``: bits 8..9 of group g's index), ``scales[8]`` (block j's 4-bit scale in nibble j mod 2 of byte j/2).
``x = d·(0.5 + sc)·0.25·GRID[index][i]·(±1)``, ``GRID`` gguf-py's ``IQ2_S.grid`` (8, 25, 43 for levels 0..2).

Encoding follows ggml's ``quantize_row_iq2_s_impl``: error weights ``0.25·σ² + x²``, or with an importance matrix
``qw·sqrt(σ² + x²)``, σ² = 2·mean(x²) over the super-block; per block of 16 IQ3_S's search (`iq3_s.block_fit`)
on |x| over this grid: levels 0..2, 19 trial inverse scales ``(5 + 0.1·t)/max`` (t in −9..9), neighbour lists of
the single smallest distance, only the off-grid groups re-snapped; a block whose largest |x| is below 1e-8 is
empty (all-zero entries). ``d = max/31`` stored ×0.9875, block scales ``round((s/d − 1)/2)``. llama-quantize
requires an importance matrix for IQ2_S tensors (ggml does not). Shapes: ``[N, 256]`` <-> ``[N, 82]`` uint8.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, importance_weights, mean_square
from compress.formats.gguf.iq2_xs import level_codes
from compress.formats.gguf.iq3_s import Tables, block_fit, tables
from compress.formats.gguf.lattice import HalfStepGrid, decoded, super_blocks
from compress.formats.gguf.sizes import QK_K, GGMLType

KIND = GGMLType.IQ2_S
SUB = 16  # weights per block scale
TINY = 1e-8  # ggml's GROUP_MAX_EPS_IQ2_S


@cache
def grid_values() -> np.ndarray:
    """gguf-py's ``IQ2_S.grid``: the 1024 points' decoded values ``[1024, 8]`` (8, 25, 43)."""
    from gguf.quants import IQ2_S

    IQ2_S.init_grid()
    return np.asarray(IQ2_S.grid, dtype=np.float32).reshape(1024, 8)


def grid_tables() -> Tables:
    """ggml's ``iq2xs_init_impl(IQ2_S)``: ``kgrid_2bit_1024``, neighbours at the smallest distance only."""
    return tables(level_codes(grid_values()), 1, group=8, bits=2, max_level=2)


def _weights(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    sigma2 = mean_square(x, 2.0)
    if qw is None:
        return (F32(0.25) * sigma2 + x * x).astype(F32)
    return importance_weights(x, qw.astype(F32, copy=False), sigma2)


def fit(blocks: np.ndarray, qw: np.ndarray | None = None) -> tuple[HalfStepGrid, np.ndarray, np.ndarray]:
    """(grid, points ``[N, 32]``, negative ``[N, 256]``) of ggml's encoder; with ``qw`` its imatrix fit."""
    x = blocks.astype(F32, copy=False)
    scales, points = block_fit(np.where(x >= 0, x, -x).reshape(-1, SUB), _weights(x, qw).reshape(-1, SUB), grid_tables(),
                               steps=9, tiny=TINY, resnap_all=False, base=5, increment=0.1)
    return super_blocks(scales, points, ~(x >= 0), 0.9875, 0.25)


def fit_grid(blocks: np.ndarray, qw: np.ndarray | None = None) -> HalfStepGrid:
    """The grid of `fit`, for points and signs chosen elsewhere (GPTQ)."""
    return fit(blocks, qw)[0]


def codebook() -> np.ndarray:
    """The 1024 grid points' decoded magnitudes ``[1024, 8]`` float32 (8, 25, 43)."""
    return grid_values()


def pack(grid: HalfStepGrid, points: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Bytes of ``[N, 32]`` grid points and ``[N, 256]`` signs on ``grid``."""
    n = points.shape[0]
    signs = (negative.reshape(n, 32, 8).astype(np.uint8) << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)
    high = ((points >> 8) & 3).astype(np.uint8).reshape(n, 8, 4)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))).sum(axis=2, dtype=np.uint8)
    scales = (grid.sc[:, 0::2] | (grid.sc[:, 1::2] << 4)).astype(np.uint8)
    return np.concatenate([fp16_bytes(grid.d), (points & 255).astype(np.uint8), signs, qh, scales], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    return pack(*fit(blocks))


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_iq2_s`` with an importance matrix (σ² is the super-block's, not the row's)."""
    return pack(*fit(blocks, qw))


def decode(data: np.ndarray) -> np.ndarray:
    n = data.shape[0]
    high = (data[:, 66:74, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [N, 8, 4]
    index = data[:, 2:34].astype(np.int32) | (high.reshape(n, 32).astype(np.int32) << 8)
    negative = ((data[:, 34:66, None] >> np.arange(8, dtype=np.uint8)) & 1).astype(bool)  # [N, 32, 8]
    raw = data[:, 74:82]
    grid = HalfStepGrid(fp16_field(data, 0), np.stack([raw & 15, raw >> 4], axis=2).reshape(n, QK_K // SUB), 0.25)
    return decoded(grid, grid_values()[index].reshape(n, QK_K // SUB, SUB), negative.reshape(n, QK_K // SUB, SUB))
