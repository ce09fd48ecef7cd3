"""IQ2_XXS: super-blocks of 256 weights in 8 blocks of 32, magnitudes from a 256-point grid in 8-D (2 bits a
coordinate), signs of each 8 with even parity (2.0625 bpw). Needs an importance matrix, as in ggml.

Layout (``block_iq2_xxs``, ggml ``ggml-common.h``): ``d`` (f16), then per block of 32 two little-endian uint32:
the first holds its 4 groups' 8-bit grid indices (byte k: group k), the second in bits 7k..7k+6 the signs of
group k (bit i: element 8k + i is negative; the 8th sign is the parity of the 7) and in bits 28..31 the 4-bit
scale. ``x = d·(0.5 + sc)·0.25·GRID[index][i]·(±1)``, ``GRID`` gguf-py's ``IQ2_XXS.grid`` (8, 25, 43).

Encoding follows ggml's ``quantize_row_iq2_xxs_impl``: error weights ``qw·sqrt(σ² + x²)`` (σ² = mean(x²) over
the super-block), signs as IQ3_XXS fixes them (`iq3_xxs.parity_signs`); per block a first scale from
`make_qp_quants` (levels 0..4 of the signed magnitudes), then IQ3_S's search (`iq3_s.block_fit`) with 13 trial
inverse scales ``(5 + 0.1·t)/(3·scale)`` (t in −6..6), neighbour lists of the 2 smallest distances, and every
group re-snapped at the fitted scale whatever the trials found. A block whose largest value is below 1e-15, or
whose first scale is not positive, is empty (all-zero entries). ``d = max/31``, block scales
``round((s/d − 1)/2)``. Shapes: ``[N, 256]`` <-> ``[N, 66]`` uint8.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from compress.formats.gguf._common import F32, GROUP_MAX_EPS, fp16_bytes, fp16_field, importance_weights, mean_square
from compress.formats.gguf.solvers import make_qp_quants
from compress.formats.gguf.iq2_xs import level_codes
from compress.formats.gguf.iq3_s import Tables, block_fit, tables
from compress.formats.gguf.lattice import HalfStepGrid, decoded, parity_negative, parity_signs, super_blocks
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.IQ2_XXS
NEEDS_IMPORTANCE = True  # ggml asserts on a missing importance matrix (``quantize_row_iq2_xxs_impl``)
SIGN_PARITY = 8
SUB = 32  # weights per block scale
K_MAX_Q = 3  # levels 0..2


@cache
def grid_values() -> np.ndarray:
    """gguf-py's ``IQ2_XXS.grid``: the 256 points' decoded values ``[256, 8]`` (8, 25, 43)."""
    from gguf.quants import IQ2_XXS

    IQ2_XXS.init_grid()
    return np.asarray(IQ2_XXS.grid, dtype=np.float32).reshape(256, 8)


def grid_tables() -> Tables:
    """ggml's ``iq2xs_init_impl(IQ2_XXS)``: ``kgrid_2bit_256``, neighbours at the 2 smallest distances."""
    return tables(level_codes(grid_values()), 2, group=8, bits=2, max_level=2)


def fit(blocks: np.ndarray, qw: np.ndarray) -> tuple[HalfStepGrid, np.ndarray, np.ndarray]:
    """(grid, points ``[N, 32]``, negative ``[N, 256]``) of ggml's importance-weighted encoder."""
    x = blocks.astype(F32, copy=False)
    w = importance_weights(x, qw.astype(F32, copy=False), mean_square(x))
    negative, xval = parity_signs(x, w)
    xb, wb = xval.reshape(-1, SUB), w.reshape(-1, SUB)
    first, _ = make_qp_quants(xb, K_MAX_Q + 1, wb)
    eff_max = (first * F32(K_MAX_Q)).astype(F32)
    empty = (xb.max(axis=1) < GROUP_MAX_EPS) | (eff_max <= 0)
    scales, points = block_fit(xb, wb, grid_tables(), steps=6, base=5, increment=0.1, top=np.where(empty, F32(0), eff_max),
                               scale0=first, resnap_always=True)
    return super_blocks(scales, points, negative, 1.0, 0.25)


def fit_grid(blocks: np.ndarray, qw: np.ndarray) -> HalfStepGrid:
    """The grid of `fit`, for points and signs chosen elsewhere (GPTQ)."""
    return fit(blocks, qw)[0]


def codebook() -> np.ndarray:
    """The 256 grid points' decoded magnitudes ``[256, 8]`` float32 (8, 25, 43)."""
    return grid_values()


def pack(grid: HalfStepGrid, points: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Bytes of ``[N, 32]`` grid points and ``[N, 256]`` signs (each 8 with even parity) on ``grid``."""
    n = points.shape[0]
    bits = negative.reshape(n, 8, 4, 8)[..., :7].astype(np.uint32) << np.arange(7, dtype=np.uint32)
    words = (bits.sum(axis=3) << (7 * np.arange(4, dtype=np.uint32))).sum(axis=2, dtype=np.uint32)
    words = (words | (grid.sc.astype(np.uint32) << 28)).astype("<u4")
    pairs = np.concatenate([points.astype(np.uint8).reshape(n, 8, 4), words.view(np.uint8).reshape(n, 8, 4)], axis=2)
    return np.concatenate([fp16_bytes(grid.d), pairs.reshape(n, 64)], axis=1)


def encode(blocks: np.ndarray) -> np.ndarray:
    raise ValueError("IQ2_XXS needs an importance matrix (ggml's encoder has no fit without one): pass an imatrix")


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_iq2_xxs`` with an importance matrix (σ² is the super-block's, not the row's)."""
    return pack(*fit(blocks, qw))


def decode(data: np.ndarray) -> np.ndarray:
    n = data.shape[0]
    pairs = data[:, 2:66].reshape(n, 8, 8)
    words = np.ascontiguousarray(pairs[:, :, 4:]).view("<u4").reshape(n, 8).astype(np.uint32)
    negative = parity_negative((words[..., None] >> (7 * np.arange(4, dtype=np.uint32))) & 127)  # [N, 8, 4, 8]
    values = grid_values()[pairs[:, :, :4].astype(np.int64)].reshape(n, 8, SUB)
    return decoded(HalfStepGrid(fp16_field(data, 0), words >> 28, 0.25), values, negative.reshape(n, 8, SUB))
