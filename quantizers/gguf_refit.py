"""Each GGML block's float16 scales solved against the whole Hessian, its codes kept: the last step of GPTQ in GGML grids.

GPTQ (Frantar et al., ICLR 2023) in a GGUF type's grids (`compress.quantizers.gguf_gptq`) fits each block's grid
when its first column is reached, to the columns as they are then and with only ``diag(H)`` as the importance
(ggml's weighted fit), and cannot see the columns after it. Once every code is fixed, the layer's proxy loss is a
quadratic in each block's stored float16 scale ``d`` and min (``dmin``, Q4_1/Q5_1's ``m``): every weight decodes
linearly in the two (`compress.formats.gguf.sizes.SCALE_FIELDS`). So each row's scales have a closed form.

Objective, per row ``w [in]`` of ``W [out, in]`` with its decode ``q``: the block ``b``'s weights decode to
``α_b·u_b + β_b·v_b`` (``u_b`` the part that scales with ``d``, ``v_b`` the part that scales with the min field,
zero outside block ``b``; today's bytes are ``α = β = 1``), and

    min over δ = (α, β) − 1 of  (w − q − Σ_k δ_k z_k) H (w − q − Σ_k δ_k z_k)ᵀ
        = e H eᵀ − 2 δᵀg + δᵀAδ,   e = w − q,  g_k = z_k H eᵀ,  A_kl = z_k H z_lᵀ,   δ* = A⁻¹ g

(``z`` the ``u`` and ``v`` parts of every block). The new ``d·α`` and min are rounded to float16, and the rounded
``δ`` gives the row's exact gain ``2δᵀg − δᵀAδ``; a row whose rounded solution does not lower its loss keeps its
bytes. A small ridge (1e-6 of A's mean diagonal) makes blocks whose codes decode to zero solvable (their δ is 0),
and each factor is kept within [1/2, 2]: a block that few inputs reach cannot swing far on them.

Shapes: ``weight [out, in]`` float, ``hessian [in, in]`` (undamped; a dead column's row and column zero),
``data [out, row_bytes]`` uint8 of ``kind``; returns the new bytes, their decode ``[out, in]`` float32 and each
row's gain ``[out]`` float64. The inputs are not modified. Cost: ``W·H`` (unless given) and, in parts of rows,
one ``[rows, B] × [B, in]`` product per block and part (``out·in²`` multiply-adds per part).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compress.formats.gguf.codecs import decode_tensor
from compress.formats.gguf.sizes import BLOCK_SIZES, SCALE_FIELDS, GGMLType, bits_per_weight
from compress.quantizers.threads import even_runs, one_thread, one_thread_workers, share_runs

RIDGE = 1e-6
FACTOR_RANGE = (0.5, 2.0)
PART_BYTES = 1 << 20  # each part of rows' products ``[rows, in]`` float32 stays in the caches


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
                 weight_h: torch.Tensor | None = None, decoded: torch.Tensor | None = None) -> ScaleRefit:
    """Each block's float16 scale (and min) of ``data`` re-solved for ``min tr((W − Q) H (W − Q)ᵀ)``, codes kept.
    Where the caller has them: ``weight_h`` ``W·H`` ``[out, in]`` float32 (GPTQ's energy ``tr(W H Wᵀ)`` needs it
    too) and ``decoded``, the decode of ``data``."""
    if not refittable(kind):
        raise ValueError(f"{kind.name} stores no float16 block scale to solve")
    rows, cols = weight.shape
    B, size = BLOCK_SIZES[kind]
    nb = cols // B
    blocks = np.ascontiguousarray(data).reshape(rows, nb, size)
    W = weight.detach().cpu().float()
    H = hessian.detach().cpu().float()
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

    WH = W @ H if weight_h is None else weight_h.cpu().float()
    factors = np.ones((rows, len(parts) * nb))
    gain = torch.zeros(rows, dtype=torch.float64)
    step = max(1, PART_BYTES // (4 * cols))
    parts_of_rows = [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]  # by the shape alone: the same bits anywhere

    def solve(r0: int, r1: int) -> None:
        z = [p[r0:r1].view(r1 - r0, nb, B) for p in parts]
        A = _normal_matrix(z, H)
        # g_k = z_k H (w − q)ᵀ = z_k·(wH) − Σ_l A_kl, as q is the sum of every part of every block
        g = torch.cat([(zk * WH[r0:r1].view(r1 - r0, nb, B)).sum(-1) for zk in z], 1).double() - A.sum(-1)
        ridge = RIDGE * A.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(torch.finfo(torch.float64).tiny)
        delta = torch.linalg.solve(A + ridge[:, None, None] * torch.eye(A.shape[-1], dtype=A.dtype), g[..., None])[..., 0]
        wanted = (1 + delta).clamp_(*FACTOR_RANGE).numpy()
        # the factors the float16 fields can hold: (d·α rounded) / d, 1 where d is 0
        held = np.concatenate([_held(s[r0:r1], wanted[:, k * nb : (k + 1) * nb]) for k, s in enumerate(stored)], 1)
        dh = torch.from_numpy(held - 1)
        row_gain = 2 * (dh * g).sum(1) - torch.einsum("rk,rkl,rl->r", dh, A, dh)
        better = (row_gain > 0).numpy()
        factors[r0:r1][better] = held[better]
        gain[r0:r1] = torch.where(row_gain > 0, row_gain, 0.0)

    def run(a: int, b: int) -> None:
        for r0, r1 in parts_of_rows[a:b]:
            solve(r0, r1)

    # small operations: each part of rows on one thread, the parts shared between threads (`compress.quantizers.threads`)
    threads = min(torch.get_num_threads(), len(parts_of_rows))
    with one_thread(W.device), one_thread_workers(threads - 1) as pool:
        share_runs(pool, run, even_runs(len(parts_of_rows), threads))

    out = blocks.copy()
    for k, (at, s) in enumerate(zip(fields, stored)):
        out[:, :, at : at + 2] = (s * factors[:, k * nb : (k + 1) * nb]).astype("<f2")[..., None].view(np.uint8)
    out = out.reshape(rows, -1)
    return ScaleRefit(out, torch.from_numpy(decode_tensor(out, kind, cols)), gain)


def _field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block ``[rows, nb, size]`` -> float32 ``[rows, nb]``."""
    return np.ascontiguousarray(blocks[:, :, at : at + 2]).view("<f2")[..., 0].astype(np.float32)


def _held(stored: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``stored · wanted`` rounded to float16, as a factor of ``stored`` (1 where ``stored`` is 0)."""
    new = (stored * wanted).astype(np.float16).astype(np.float64)
    live = (stored != 0) & np.isfinite(new)
    return np.where(live, new / np.where(live, stored, 1.0), 1.0)


def _normal_matrix(z: list[torch.Tensor], H: torch.Tensor) -> torch.Tensor:
    """``A [rows, P·nb, P·nb]`` float64, ``A_kl = z_k H z_lᵀ`` for the parts ``z`` (each ``[rows, nb, B]``) of the rows.
    ``A`` is symmetric, so only the pairs of blocks ``l >= k`` are summed, from one ``[rows, B] × [B, in − kB]``
    product per block and part (half of ``z H zᵀ``'s work); the others are their mirror images."""
    rows, nb, B = z[0].shape
    P = len(z)
    flat = [zp.reshape(rows, nb * B) for zp in z]
    A = torch.empty(rows, P, nb, P, nb, dtype=torch.float32)
    for k in range(nb):
        lo = k * B
        right = H[lo : lo + B, lo:]  # block k's rows of H, over the blocks l >= k
        for p in range(P):
            y = flat[p][:, lo : lo + B] @ right  # [rows, in − kB]
            for q in range(P):
                A[:, p, k, q, k:] = (y * flat[q][:, lo:]).view(rows, nb - k, B).sum(-1)
    A = A.view(rows, P * nb, P * nb)
    block = torch.arange(P * nb) % nb
    mirrored = block[None, :] < block[:, None]  # (p, k), (q, l) with l < k: the mirror of (q, l), (p, k)
    return torch.where(mirrored, A.transpose(1, 2), A).double()
