"""Triton kernel for an online rotation (`compress.quantizers.rotation.online_rotation`, compressed-tensors'
``HadamardTransform`` on a layer's input): ``y = x · diag(H, …, H) / √b`` for ``x [M, n]`` and a ±1 matrix
``H [b, b]``, ``b`` dividing ``n`` (one block of the whole width, or Sylvester blocks).

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y`` inside one block of ``b`` columns: the tile's rows of
that block of ``x`` times a ``[b, BLOCK_N]`` slice of ``H``, ``tl.dot`` in float32 with IEEE products (no TF32:
``H``'s entries are ±1, so every product is exact and only the summation order differs from the reference), then
divided by ``√b`` and rounded once to ``x``'s dtype. ``BLOCK_N`` and ``BLOCK_K`` divide ``b``, so no tile straddles
two blocks. Runs on CUDA, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, the tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from compress.kernels.triton_int import _round

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rotation_kernel(x, sx_m, h, out, so_m, M, B, root,
                     OUT: tl.constexpr, INTERPRET: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(1) * BLOCK_N  # the tile's first output column
    base = (first // B) * B  # the first column of its block
    cols = first + tl.arange(0, BLOCK_N)
    inside = cols - base  # the columns of H
    live = rows[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, B, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x + rows[:, None] * sx_m + (base + k)[None, :], mask=live, other=0.0).to(tl.float32)
        w = tl.load(h + k[:, None] * B + inside[None, :])
        acc += tl.dot(a, w, input_precision="ieee")
    tl.store(out + rows[:, None] * so_m + cols[None, :], _round(acc / root, OUT, INTERPRET), mask=live)


def _tile(b: int) -> int | None:
    """The column tile: the largest power of two up to 64 dividing ``b``, at least 16 (``tl.dot``'s minimum)."""
    tile = min(b & -b, 64)
    return tile if tile >= 16 else None


def supported(x: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether the kernel takes this input and matrix (else the torch reference runs)."""
    return (x.dtype in TL_DTYPES and h.dtype == torch.float32 and x.shape[-1] % h.shape[0] == 0
            and _tile(h.shape[0]) is not None and x.numel() > 0)


def online_rotation(x: torch.Tensor, h: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """``x [..., n] · diag(H, …, H) / √b`` in ``x``'s dtype, ``H = h [b, b]`` float32 (see `supported`)."""
    b, n = h.shape[0], x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tile = _tile(b)
    grid = (triton.cdiv(m, block_m), n // tile)
    _rotation_kernel[grid](rows, rows.stride(0), h.contiguous(), out, out.stride(0), m, b, float(b) ** 0.5,
                           OUT=TL_DTYPES[x.dtype], INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
                           BLOCK_M=block_m, BLOCK_N=tile, BLOCK_K=tile)
    return out.reshape(x.shape)
