"""IQ4_XS: super-blocks of 256 weights in 8 blocks of 32, IQ4_NL's codebook with 6-bit block scales (4.25 bpw).

Layout (``block_iq4_xs``, ggml ``ggml-common.h``): ``d`` (f16), ``scales_h`` (uint16: bits 2j, 2j+1 are
the top two bits of block j's scale), ``scales_l[4]`` (block j's low four bits in nibble j mod 2 of byte
j/2), ``qs[128]`` (block j: ``qs[16j + l]`` holds elements ``32j + l`` (low nibble) and ``32j + 16 + l``).
``x = d·(ls_j − 32)·KVALUES[q]`` (`iq4_nl.KVALUES`).

Encoding follows ggml's ``quantize_iq4_xs`` (``quantize_row_iq4_nl_impl`` with super_block_size 256,
``ntry = 7``): every block of 32 gets IQ4_NL's scale (`iq4_nl.sub_block_scales`; with an imatrix σ² is
2·mean(x²) over the super-block); ``d = −s/32`` for the block scale s of largest magnitude, the block
scales are rounded to ``l = clamp(round(s/d), −32, 31)``, and each block's codes are the nearest entries
of ``x·(1/(d·l))`` with the unrounded d. Shapes: blocks ``[N, 256]`` float32 <-> ``[N, 136]`` uint8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compress.formats.gguf._common import F32, fp16_bytes, fp16_field, nearest_int, nibbles, safe_reciprocal, signed_absmax
from compress.formats.gguf import iq4_nl
from compress.formats.gguf.iq4_nl import LEVELS, SUB, error_weights, nearest_level, sub_block_scales
from compress.formats.gguf.sizes import QK_K, GGMLType

KIND = GGMLType.IQ4_XS
CODES = iq4_nl.CODES  # the weight is d·(sc − 32)·LEVELS[code]


@dataclass(frozen=True)
class XSGrid:
    """``d`` ``[N, 1]`` (float32; float16-exact once read back) and the stored 6-bit scales ``sc`` ``[N, 8]``
    (``l + 32``)."""

    d: np.ndarray
    sc: np.ndarray

    def scale(self) -> np.ndarray:
        """Per block ``d·(sc − 32)`` ``[N, 8]``, as the decoder computes it."""
        return self.d * (self.sc.astype(np.int32) - 32).astype(F32)


def fit_grid(blocks: np.ndarray, qw: np.ndarray | None = None) -> XSGrid:
    """The super-block grid before the float16 store of ``d``; with ``qw`` ``[N, 256]`` the imatrix fit."""
    n = blocks.shape[0]
    weights = error_weights(blocks, qw)
    scales = sub_block_scales(blocks.reshape(-1, SUB), weights.reshape(-1, SUB)).reshape(n, QK_K // SUB)
    largest = signed_absmax(scales)
    largest = np.where(largest == 0, F32(0), largest)  # ggml starts from +0: an all-zero block stores d = −0
    d = (-largest / F32(32)).astype(F32)
    levels = np.clip(nearest_int(safe_reciprocal(d) * scales), -32, 31)
    return XSGrid(d, (levels + 32).astype(np.uint8))


def round_codes(blocks: np.ndarray, grid: XSGrid) -> np.ndarray:
    """Codes ``[N, 256]``: per block the nearest entries of ``x·(1/(d·l))`` (entry 8 where that step is 0)."""
    n = blocks.shape[0]
    x = blocks.astype(F32, copy=False).reshape(n, QK_K // SUB, SUB)
    return nearest_level(x * safe_reciprocal(grid.scale())[..., None]).reshape(n, QK_K)


def pack(grid: XSGrid, codes: np.ndarray) -> np.ndarray:
    sc = grid.sc.astype(np.uint16)
    scales_h = (((sc >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    scales_l = nibbles(sc[:, 0::2], sc[:, 1::2])
    q = codes.reshape(-1, 8, 2, 16)
    qs = nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)
    return np.concatenate([fp16_bytes(grid.d), scales_h.astype("<u2").reshape(-1, 1).view(np.uint8), scales_l, qs], axis=1)


def unpack(data: np.ndarray) -> tuple[XSGrid, np.ndarray]:
    scales_h = np.ascontiguousarray(data[:, 2:4]).view("<u2").astype(np.uint16)  # [N, 1]
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = data[:, 4:8]
    low = np.stack([low & 15, low >> 4], axis=2).reshape(-1, 8)
    qs = data[:, 8:136].reshape(-1, 8, 1, 16)
    codes = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, QK_K)
    return XSGrid(fp16_field(data, 0), (low | (high.astype(np.uint8) << 4)).astype(np.uint8)), codes


def encode(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks)
    return pack(grid, round_codes(blocks, grid))


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_iq4_xs`` with an importance matrix (σ² is the super-block's, not the row's)."""
    blocks = blocks.astype(F32, copy=False)
    grid = fit_grid(blocks, qw)
    return pack(grid, round_codes(blocks, grid))


def decode(data: np.ndarray) -> np.ndarray:
    grid, codes = unpack(data)
    q = LEVELS[codes].reshape(-1, QK_K // SUB, SUB)
    return (grid.scale()[..., None] * q).reshape(-1, QK_K)
