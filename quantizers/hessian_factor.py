"""The factor GPTQ-style solvers (GPTQ, SparseGPT, GPTQ in GGUF grids) need: ``U`` upper triangular with
``UᵀU = (H + λI)⁻¹``, i.e. the upper Cholesky factor of the damped inverse Hessian (GPTQ, Section 4).

The reference implementation computes it as ``cholesky`` → ``cholesky_inverse`` → ``cholesky(upper=True)``. Here,
with ``J`` the reversal permutation: if ``J H J = L Lᵀ`` (lower Cholesky), then ``H⁻¹ = (J L⁻¹ J)ᵀ (J L⁻¹ J)`` and
``J L⁻¹ J`` is upper triangular with a positive diagonal, so by uniqueness ``U = J L⁻¹ J``: one factorization and
one triangular inverse, and ``H⁻¹`` is never formed (measured: closer to a float64 factor, 1.8e-7 vs 3.2e-7
relative on random 576–2048 wide Hessians).

Both steps run in blocks of `BLOCK` rows (`WIDE_BLOCK` from `WIDE` columns on): each diagonal block is factored
and inverted on one thread, and all the rest is matrix products whose inner dimension is one block. torch's
float32 Cholesky (MKL) rounds differently with 1 and 2 threads, which made GPTQ's codes depend on the machine's
core count; the products are cut into tiles fixed by their shapes alone, each computed on one thread
(`threads.FixedTileProducts`: MKL's own threaded product summed the edges of each thread's share in another order
on some CPUs), so this factor is the same bit for bit whatever the thread count (tested with 1–4 threads,
`tests/quantizers/test_hessian_factor.py`), while using them. The fixed tiles cost some speed against MKL's own
threaded products (1536 wide on two threads of a 2-core CPU: 55–64 ms against 38–46 ms), which reproducible codes
are worth; `WIDE_BLOCK` takes larger blocks for the widest matrices, where the products dominate (14336 wide, an
8B model's MLP down projection: 14.1–14.6 s on two threads, 15.4–15.6 s with 128-row blocks).

Shapes: ``H [n, n]`` symmetric positive definite; ``U [n, n]``.
"""

from __future__ import annotations

import torch

from compress.quantizers.finite import all_finite
from compress.quantizers.threads import FixedTileProducts

BLOCK = 128  # rows per step: the diagonal blocks' factorizations are one-thread work, the products between them large
# from WIDE columns on, WIDE_BLOCK rows per step: the products' inner dimension is the block, and at 128 they ran
# below this CPU's rate (2 threads, alternating: 4096 wide 522-537 -> 485-494 ms, 8192 wide 3.49-3.80 -> 3.06-3.40 s);
# narrower, the one-thread diagonal blocks dominate (576 wide: 6 ms at 128, 8-9 ms at 256)
WIDE, WIDE_BLOCK = 4096, 256
PANEL = 1024  # columns per product of the trailing update, which skips the blocks above the diagonal (half its work)


def block_rows(n: int) -> int:
    """Rows per step of the factorization and the inverse of an ``n``-wide matrix."""
    return WIDE_BLOCK if n >= WIDE else BLOCK


def upper_inverse_factor(H: torch.Tensor) -> torch.Tensor | None:
    """``U`` upper triangular with ``UᵀU = H⁻¹`` (module docstring); None if ``H`` is not positive definite."""
    n = H.shape[0]
    A = H.flip(0, 1)  # J H J, a copy: becomes L in its lower triangle
    # the products (and the one-thread work) in `FixedTileProducts`; whole-matrix elementwise steps outside it keep
    # torch's threads
    with FixedTileProducts(H.device) as product:
        inverses = _lower_cholesky_(A, product)
    if inverses is None:
        return None
    L = A.tril_()
    X = torch.eye(n, dtype=H.dtype, device=H.device)
    with FixedTileProducts(H.device) as product:
        _lower_inverse_(X, L, inverses, product)
    return X.flip(0, 1)


def _lower_cholesky_(A: torch.Tensor, product: FixedTileProducts) -> list[torch.Tensor] | None:
    """Right-looking blocked Cholesky in place: ``A``'s lower triangle becomes L (above it is left stale). Returns
    each diagonal block's inverse ``L_kk⁻¹``, or None if ``A`` is not positive definite."""
    n = A.shape[0]
    block = block_rows(n)
    eye = torch.eye(min(block, n), dtype=A.dtype, device=A.device)
    inverses = []
    for k in range(0, n, block):
        e = min(k + block, n)
        L11, info = torch.linalg.cholesky_ex(A[k:e, k:e])
        if info.item() != 0:
            return None
        inverses.append(torch.linalg.solve_triangular(L11, eye[: e - k, : e - k], upper=False))
        A[k:e, k:e] = L11
        if e < n:
            L21 = product(A[e:, k:e], inverses[-1].t())
            A[e:, k:e] = L21
            for j in range(e, n, PANEL):  # the trailing update on and below the diagonal only (nothing reads above)
                j2 = min(j + PANEL, n)
                product(L21[j - e :], L21[j - e : j2 - e].t(), into=A[j:, j:j2], subtract=True)
    return inverses


def _lower_inverse_(X: torch.Tensor, L: torch.Tensor, inverses: list[torch.Tensor], product: FixedTileProducts) -> None:
    """Solves ``L X = I`` block row by block row, in place (``X`` starts as the identity): ``X = L⁻¹``."""
    n = X.shape[0]
    block = block_rows(n)
    for inverse, k in zip(inverses, range(0, n, block)):
        e = min(k + block, n)
        X[k:e, :e] = product(inverse, X[k:e, :e])
        if e < n:
            product(L[e:, k:e], X[k:e, :e], into=X[e:, :e], subtract=True)


def inverse_hessian_factor(H: torch.Tensor, damp: float, max_retries: int) -> tuple[torch.Tensor, float, float, int]:
    """`upper_inverse_factor` of ``H + λI`` with ``λ = damp · mean(diag H)``.

    When the factorization fails or is not finite, ``damp`` is multiplied by 10, up to ``max_retries`` times.
    Returns ``(U, damp, λ, retries)``. ``H`` must be the caller's own copy: it is damped in place (for a large layer
    every extra [in, in] copy is hundreds of MB).
    """
    diagonal = torch.diagonal(H).clone()
    mean_diag = float(diagonal.mean())
    for retry in range(max_retries + 1):
        rel = damp * 10**retry
        lam = rel * mean_diag
        torch.diagonal(H).copy_(diagonal + lam)
        factor = upper_inverse_factor(H)
        if factor is not None and all_finite(factor):
            return factor, rel, lam, retry
    raise ValueError(
        f"hessian is not positive definite even with damp {damp * 10**max_retries:g} "
        f"(mean diagonal {mean_diag:g}, {max_retries} retries)"
    )
