"""Each GGML block's float16 scales solved against the whole Hessian, its codes kept: the last step of GPTQ in GGML grids.

GPTQ in a GGUF type's grids (`compress.quantizers.gguf_gptq`) fits each block's grid when its first column is
reached, to the columns as they are then and with only ``diag(H)`` as the importance (ggml's weighted fit). Once every
code is fixed, every weight of a block decodes linearly in the block's stored float16 scale ``d`` and min (``dmin``,
Q4_1/Q5_1's ``m``; `compress.formats.gguf.sizes.SCALE_FIELDS`), so the layer's proxy loss is a quadratic in them:
`compress.quantizers.scale_refit` solves it. The parts it scales are the decode with the min field zeroed (the part
that moves with ``d``) and the rest (the part that moves with the min); the solved ``d·α`` and ``min·β`` are rounded
to float16, and a row keeps its bytes where the rounded solution does not lower its loss.

Shapes: ``weight [out, in]`` float, ``hessian [in, in]`` (undamped), ``data [out, row_bytes]`` uint8 of ``kind``;
returns the new bytes, their decode ``[out, in]`` float32 and each row's gain ``[out]`` float64. The inputs are not
modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compress.formats.gguf.codecs import decode_tensor
from compress.formats.gguf.sizes import BLOCK_SIZES, SCALE_FIELDS, GGMLType, bits_per_weight
from compress.quantizers.scale_refit import held_factors, refit_factors


@dataclass(frozen=True)
class ScaleRefit:
    data: np.ndarray  # [out, row_bytes] uint8: the input's bytes with each block's d (and min) re-solved
    weight: torch.Tensor  # [out, in] float32: their decode
    gain_rows: torch.Tensor  # [out] float64: each row's proxy loss lowered by this (>= 0)


def refittable(kind: GGMLType) -> bool:
    return kind in SCALE_FIELDS


def worth_refitting(kind: GGMLType) -> bool:
    """Below 8 bits a weight: an 8-bit grid's step is fine enough that its refit changed nothing measurable (SmolLM2's
    q4_k_m by llama.cpp's KLD, its Q8_0 layers refitted or not: 0.02790 and 0.02803, within the file's ±2 % from
    bit-level changes) and its tied Q8_0 output layer was a quarter of the refit's time in that export."""
    return refittable(kind) and bits_per_weight(kind) < 8


def refit_scales(weight: torch.Tensor, hessian: torch.Tensor, data: np.ndarray, kind: GGMLType,
                 weight_h: torch.Tensor | None = None, decoded: torch.Tensor | None = None,
                 into: torch.Tensor | None = None) -> ScaleRefit:
    """Each block's float16 scale (and min) of ``data`` re-solved for ``min tr((W − Q) H (W − Q)ᵀ)``, codes kept.
    Where the caller has them: ``weight_h`` ``W·H`` ``[out, in]`` float32 (GPTQ's energy ``tr(W H Wᵀ)`` needs it
    too) and ``decoded``, the decode of ``data``; ``into``: a C-contiguous float32 CPU ``[out, in]`` for the new
    decode (the result's ``weight``)."""
    if not refittable(kind):
        raise ValueError(f"{kind.name} stores no float16 block scale to solve")
    rows, cols = weight.shape
    B, size = BLOCK_SIZES[kind]
    nb = cols // B
    blocks = np.ascontiguousarray(data).reshape(rows, nb, size)
    Q = torch.from_numpy(decode_tensor(data, kind, cols)) if decoded is None else decoded.cpu().float()
    d_at, min_at = SCALE_FIELDS[kind]
    parts = [Q]
    if min_at is not None:  # Q = (the d part) + (the min part): the d part is the decode with the min field zeroed
        zeroed = blocks.copy()
        zeroed[:, :, min_at : min_at + 2] = 0
        scaled = torch.from_numpy(decode_tensor(zeroed.reshape(rows, -1), kind, cols))
        parts = [scaled, Q - scaled]
    fields = [d_at] if min_at is None else [d_at, min_at]
    stored = [_field(blocks, at).astype(np.float64) for at in fields]  # each [rows, nb]

    def hold(r0: int, r1: int, wanted: np.ndarray) -> np.ndarray:
        # the factors the float16 fields can hold: (d·α rounded) / d, 1 where d is 0
        return np.concatenate([held_factors(s[r0:r1], wanted[:, k * nb : (k + 1) * nb], np.float16) for k, s in enumerate(stored)], 1)

    factors, gain = refit_factors(weight, hessian, parts, B, hold, weight_h)
    out = blocks.copy()
    for k, (at, s) in enumerate(zip(fields, stored)):
        out[:, :, at : at + 2] = (s * factors[:, k * nb : (k + 1) * nb]).astype("<f2")[..., None].view(np.uint8)
    out = out.reshape(rows, -1)
    decode = decode_tensor(out, kind, cols, None if into is None else into.numpy())
    return ScaleRefit(out, into if into is not None else torch.from_numpy(decode), gain)


def _field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block ``[rows, nb, size]`` -> float32 ``[rows, nb]``."""
    return np.ascontiguousarray(blocks[:, :, at : at + 2]).view("<f2")[..., 0].astype(np.float32)

