"""Block scales solved on the whole Hessian with the codes kept: the last step after a GPTQ column loop.

GPTQ (Frantar et al., ICLR 2023) fixes each group's (or GGML block's) scale before its columns are rounded: from the
columns as they are then, with at most ``diag(H)`` as the importance, blind to the columns after it. Once every code
is fixed, the layer's proxy loss is a quadratic in the scales, and each row's have a closed form. This module is that
solve; `compress.quantizers.gguf_refit` (GGUF's float16 fields) and `compress.quantizers.gptq` (integer grids) say
what a scale is and what storage can hold.

Objective, per row ``w [in]`` of ``W [out, in]``: the row's decode is the sum of ``P`` parts (``parts[p] [out, in]``:
the part that scales with each block's scale, and, for GGUF's k-quants, the part that scales with its min), each cut
into blocks of ``block`` columns; block ``b`` of part ``p`` is multiplied by ``α_pb`` (today's values: ``α = 1``):

    min over δ = α − 1 of  (e − Σ_k δ_k z_k) H (e − Σ_k δ_k z_k)ᵀ = e H eᵀ − 2 δᵀg + δᵀAδ,
        e = w − Σ parts,  z_k = block b of part p (zero elsewhere),  g_k = z_k H eᵀ,  A_kl = z_k H z_lᵀ,  δ* = A⁻¹ g.

``g_k = z_k·(wH) − Σ_l A_kl``, as the decode is the sum of every ``z``: one product ``W·H`` serves every row (and the
caller's ``tr(W H Wᵀ)``). A small ridge (1e-6 of A's mean diagonal) makes blocks that decode to zero solvable (their δ
is 0), and each factor is kept within [1/2, 2]. The caller's ``hold`` rounds the factors to what storage holds; their
exact gain ``2δᵀg − δᵀAδ`` decides per row: a row whose held factors do not lower its loss keeps ``α = 1``.

Shapes: ``weight [out, in]``, ``hessian [in, in]`` (undamped; a dead column's row and column zero), ``parts`` P
tensors ``[out, in]``; returns the factors ``[out, P·in/block]`` (float64, part-major) and each row's gain ``[out]``
(float64, >= 0, on the CPU). The products run on ``weight``'s device. Cost: ``W·H`` (unless given) and one ``[rows, block] × [block, in − kB]`` product per block and part
(half of ``out·in²`` multiply-adds per part: ``A`` is symmetric), in parts of rows on one thread each.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from compress.quantizers.threads import even_runs, one_thread, one_thread_workers, share_runs

RIDGE = 1e-6
FACTOR_RANGE = (0.5, 2.0)
PART_BYTES = 1 << 20  # each part of rows' products ``[rows, in]`` float32 stays in the caches
MIN_PRODUCT_ROWS = 64  # `row_product`

# (first row, last row + 1, the factors wanted [rows, P·nb] float64) -> the factors storage holds, 1 where it holds none
Hold = Callable[[int, int, np.ndarray], np.ndarray]


def refit_factors(weight: torch.Tensor, hessian: torch.Tensor, parts: list[torch.Tensor], block: int, hold: Hold,
                  weight_h: torch.Tensor | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """The factors of each block of each part that minimise each row's ``tr((W − Q) H (W − Q)ᵀ)``, as ``hold`` keeps
    them, and each row's gain. ``weight_h``: ``W·H`` ``[out, in]`` float32 where the caller has it."""
    rows, cols = weight.shape
    if cols % block:
        raise ValueError(f"rows of {cols} values do not split into blocks of {block}")
    nb, P = cols // block, len(parts)
    device = weight.device
    H = hessian.detach().to(device, torch.float32)
    parts = [p.detach().to(device, torch.float32) for p in parts]
    # the weight itself only for W·H: a float32 copy of a bfloat16 layer is made only where the caller has no W·H
    WH = row_product(weight.detach().float(), H) if weight_h is None else weight_h.to(device, torch.float32)
    factors = np.ones((rows, P * nb))
    gain = torch.zeros(rows, dtype=torch.float64)
    step = max(MIN_PRODUCT_ROWS, PART_BYTES // (4 * cols))  # no part padded: wide rows take more than the caches
    parts_of_rows = [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]  # by the shape alone: the same bits anywhere

    def solve(r0: int, r1: int) -> None:
        z = [p[r0:r1].view(r1 - r0, nb, block) for p in parts]
        A = _normal_matrix(z, H)
        g = torch.cat([(zk * WH[r0:r1].view(r1 - r0, nb, block)).sum(-1) for zk in z], 1).double() - A.sum(-1)
        ridge = RIDGE * A.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(torch.finfo(torch.float64).tiny)
        delta = torch.linalg.solve(A + ridge[:, None, None] * torch.eye(P * nb, dtype=A.dtype, device=device), g[..., None])[..., 0]
        held = hold(r0, r1, (1 + delta).clamp_(*FACTOR_RANGE).cpu().numpy())
        dh = torch.from_numpy(held - 1).to(device)
        row_gain = (2 * (dh * g).sum(1) - torch.einsum("rk,rkl,rl->r", dh, A, dh)).cpu()
        better = (row_gain > 0).numpy()
        factors[r0:r1][better] = held[better]
        gain[r0:r1] = torch.where(row_gain > 0, row_gain, 0.0)

    def run(a: int, b: int) -> None:
        for r0, r1 in parts_of_rows[a:b]:
            solve(r0, r1)

    # small operations: each part of rows on one thread, the parts shared between threads (`compress.quantizers.threads`)
    threads = min(torch.get_num_threads(), len(parts_of_rows)) if device.type == "cpu" else 1
    with one_thread(device), one_thread_workers(threads - 1) as pool:
        share_runs(pool, run, even_runs(len(parts_of_rows), threads))
    return factors, gain


def _normal_matrix(z: list[torch.Tensor], H: torch.Tensor) -> torch.Tensor:
    """``A [rows, P·nb, P·nb]`` float64, ``A_kl = z_k H z_lᵀ`` for the parts ``z`` (each ``[rows, nb, B]``) of the rows.
    ``A`` is symmetric, so only the pairs of blocks ``l >= k`` are summed, from one ``[rows, B] × [B, in − kB]``
    product per block and part (half of ``z H zᵀ``'s work); the others are their mirror images."""
    rows, nb, B = z[0].shape
    P = len(z)
    flat = [zp.reshape(rows, nb * B) for zp in z]
    A = torch.empty(rows, P, nb, P, nb, dtype=torch.float32, device=H.device)
    for k in range(nb):
        lo = k * B
        right = H[lo : lo + B, lo:]  # block k's rows of H, over the blocks l >= k
        for p in range(P):
            y = row_product(flat[p][:, lo : lo + B], right)  # [rows, in − kB]
            for q in range(P):
                A[:, p, k, q, k:] = (y * flat[q][:, lo:]).view(rows, nb - k, B).sum(-1)
    A = A.view(rows, P * nb, P * nb)
    block = torch.arange(P * nb, device=H.device) % nb
    mirrored = block[None, :] < block[:, None]  # (p, k), (q, l) with l < k: the mirror of (q, l), (p, k)
    return torch.where(mirrored, A.transpose(1, 2), A).double()


def row_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` whose rows have the same bits however many rows ``a`` has (what row slices solved apart need,
    `compress.engine.methods.base`): MKL takes products of a few rows down other paths (one row: its
    matrix-vector kernel), which sum in another order, so ``a`` is padded with zero rows to `MIN_PRODUCT_ROWS`.
    Measured on this project's CPU: a row's bits in products of 1, 2, 41 and 3000 rows, padded, were equal (7 shapes,
    K 32-1536), and equal on 1 and 2 threads; unpadded, one and two rows differed."""
    rows = a.shape[0]
    if rows >= MIN_PRODUCT_ROWS:
        return a @ b
    return (torch.cat([a, a.new_zeros(MIN_PRODUCT_ROWS - rows, a.shape[1])]) @ b)[:rows]


def held_factors(stored: np.ndarray, wanted: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``stored · wanted`` rounded to the storage ``dtype``, as a factor of ``stored`` (1 where ``stored`` is 0 or the
    product does not fit): what a `Hold` returns."""
    new = (stored * wanted).astype(dtype).astype(np.float64)
    live = (stored != 0) & np.isfinite(new)
    return np.where(live, new / np.where(live, stored, 1.0), 1.0)
