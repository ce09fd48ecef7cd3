"""IQ4_NL: blocks of 32 weights, one float16 scale and 4-bit indices into a non-uniform codebook (4.5 bpw).

Layout (``block_iq4_nl``, ggml ``ggml-common.h``): ``d`` (f16), ``qs[16]``: element j is ``qs[j] & 15``,
element j+16 is ``qs[j] >> 4``; ``x = d·KVALUES[q]``.

Encoding follows ggml's ``quantize_iq4_nl`` (what llama-quantize calls, with or without an imatrix):
``quantize_row_iq4_nl_impl`` with ``ntry = 7``. Per block of 32 (`sub_block_scales`, shared with IQ4_XS)
the error weights are x² (with an importance matrix ``qw·sqrt(σ² + x²)``, σ² = 2·mean(x²) over the
(super-)block); 16 trial inverse scales are tried, ``127/max`` and ``(t − 127)/max`` for t in −7..7 (the
negative ones use the codebook mirrored: it is asymmetric), each with every x/scale sent to its nearest
codebook entry (`nearest_level`, ggml's ``best_index_int8``); the scale kept is the weighted least-squares
``Σw·q·x / Σw·q²`` of the best trial. The stored codes are the nearest entries of ``x·(1/d)`` with the
unrounded d (ggml rounds before the float16 store, as for Q4_0). Sums run left to right in float32 as
ggml's loops do. Shapes: blocks ``[N, 32]`` float32 <-> ``[N, 18]`` uint8.
"""

from __future__ import annotations

import numpy as np

from compress.formats.gguf._common import (
    F32, GROUP_MAX_EPS, _running_sum, importance_weights, safe_reciprocal, signed_absmax,
)
from compress.formats.gguf.q4_0 import pack, unpack  # noqa: F401  IQ4_NL's block is Q4_0's: fp16 d, 32 codes as 16 bytes of nibbles
from compress.formats.gguf.sizes import GGMLType

KIND = GGMLType.IQ4_NL
# ggml's kvalues_iq4nl (ggml/src/ggml-common.h; the same table is gguf-py's quants.IQ4_NL.kvalues)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
LEVELS = KVALUES.astype(F32)  # the value of each code: the weight is step·LEVELS[code]
CODES = (0, 15)
SUB = 32
N_TRY = 7  # ggml's ntry: trial scales (t − 127)/max for t in −7..7


# Every entry is an integer, so the two entries around v are fixed by floor(v): their upper one's index
# for floor(v) = −128..113 (below and above, the ends), a table instead of a search per weight.
_UPPER = (np.searchsorted(LEVELS[1:-1], np.arange(-128, 114, dtype=F32), side="right") + 1).astype(np.uint8)


def nearest_level(v: np.ndarray) -> np.ndarray:
    """Index of the codebook entry nearest each float32 ``v`` (ggml's ``best_index_int8``: below the
    first or above the last entry clamps; a tie between two entries takes the upper one), as uint8."""
    v = np.asarray(v, dtype=F32)
    floor = np.clip(np.floor(v), -128, 113)
    upper = _UPPER.take(floor.astype(np.intp) + 128, mode="clip")
    # between entries lo < hi ggml takes lo iff v − lo < hi − v (float32); outside the table this
    # comparison alone picks the end entry
    return upper - (v - LEVELS.take(upper - 1) < LEVELS.take(upper) - v).astype(np.uint8)


def error_weights(blocks: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """``[N, S]`` (S = 32 or 256, ggml's super_block_size): x², or with the importance ``qw``
    ``qw·sqrt(σ² + x²)`` with σ² = Σx²·(2/S) over each row (S a power of two: exact as ggml's)."""
    x = blocks.astype(F32, copy=False)
    if qw is None:
        return x * x
    sigma2 = (_running_sum(np.ascontiguousarray((x * x).T)) * F32(2.0 / x.shape[1]))[:, None]
    return importance_weights(x, qw.astype(F32, copy=False), sigma2)


def sub_block_scales(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per block of 32 (rows of ``x``, ``w`` ``[M, 32]``) the scale ``quantize_row_iq4_nl_impl`` picks,
    ``[M]`` float32 (0 for a block whose largest |x| is below ggml's GROUP_MAX_EPS)."""
    xt = np.ascontiguousarray(x.astype(F32, copy=False).T)  # [32, M]: running sums walk rows
    wt = np.ascontiguousarray(w.astype(F32, copy=False).T)
    top = signed_absmax(x)[:, 0]
    empty = np.abs(top) < GROUP_MAX_EPS
    top = np.where(empty, F32(1), top)

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = LEVELS.take(nearest_level(iscale * xt))
        wq = wt * q
        return _running_sum(wq * xt), _running_sum(wq * q)

    sumqx, sumq2 = sums(F32(1) / (-top / F32(KVALUES[0])))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0))
        best = d * sumqx
        for t in range(-N_TRY, N_TRY + 1):
            sqx, sq2 = sums(F32(t + int(KVALUES[0])) / top)
            better = (sq2 > 0) & (sqx * sqx > best * sq2)
            d = np.where(better, sqx / sq2, d)
            best = np.where(better, d * sqx, best)
    return np.where(empty, F32(0), d).astype(F32)


def fit_grid(blocks: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """The block scale before its float16 store, ``[N, 1]``; with ``qw`` ``[N, 32]`` the imatrix fit."""
    return sub_block_scales(blocks, error_weights(blocks, qw))[:, None]


def round_codes(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Codes ``[N, 32]``: the nearest entry of ``x·(1/d)`` (entry 8, the value 1, where d is 0)."""
    return nearest_level(blocks.astype(F32, copy=False) * safe_reciprocal(d))


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    d = fit_grid(blocks)
    return pack(d, round_codes(blocks, d))


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_iq4_nl`` with an importance matrix (σ² is the block's own, not the row's)."""
    blocks = blocks.astype(F32, copy=False)
    d = fit_grid(blocks, qw)
    return pack(d, round_codes(blocks, d))


def decode(data: np.ndarray) -> np.ndarray:
    d, codes = unpack(data)
    return d * LEVELS[codes]
