"""Orthogonal Hadamard matrices of the widths language models have, for rotations (QuaRot, QuIP#, SpinQuant).

A Hadamard matrix ``H [n, n]`` has entries ±1 and ``H Hᵀ = n I``; ``H / √n`` is orthogonal and spreads every
coordinate over all ``n`` (a one-hot ``x`` becomes ``n`` entries of the same size ``1/√n``), which is what makes
outlier channels harmless to a quantization grid.

Widths that are not powers of two (SmolLM2's 576 = 36·16, 1536 = 12·128, Llama's 14336 = 28·512) are covered by
Kronecker products ``H_m ⊗ H_{2^k}``: Sylvester's construction for the power of two, and for ``m`` Paley's
constructions from a prime ``q`` (I: ``q ≡ 3 mod 4``, order ``q + 1``; II: ``q ≡ 1 mod 4``, order ``2(q + 1)``).
Chosen over block-diagonal rotations of a power-of-two block because a Kronecker product is a true Hadamard
matrix of the whole width: it mixes every channel with every other, where blocks leave outliers within one block.
A width with no such factorization (the smallest multiple of 4 is 92) is a `ValueError` naming it.

Shapes: every function returns ``[n, n]`` float64.
"""

from __future__ import annotations

import functools

import torch


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(j − i)``: the quadratic character modulo the prime ``q`` (0 on the diagonal)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    index = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[index]


def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``m`` by Paley's constructions, or None where neither applies."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if m == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    q = m - 1
    if q % 4 == 3 and _is_prime(q):  # Paley I: I + S, S skew with the Jacobsthal matrix inside
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s
    q = m // 2 - 1
    if m % 2 == 0 and q % 4 == 1 and _is_prime(q):  # Paley II: a symmetric conference matrix, doubled
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)
    return None


def sylvester(n: int) -> torch.Tensor:
    """``H_n`` for ``n`` a power of two: ``H_2n = [[H, H], [H, −H]]`` (scipy.linalg.hadamard's order)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Sylvester's construction needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=16)
def _unnormalized(n: int) -> torch.Tensor:
    power = n & -n  # the largest power of two dividing n
    while power >= 1:
        base = _paley(n // power)
        if base is not None:
            return torch.kron(base, sylvester(power))
        power //= 2
    raise ValueError(f"no Hadamard matrix of order {n} from Paley's and Sylvester's constructions "
                     "(n = m·2^k with m = 1, 2, q + 1 or 2(q + 1) for a prime q)")


def hadamard(n: int) -> torch.Tensor:
    """The orthogonal ``H_n / √n`` (deterministic)."""
    return _unnormalized(n) / n ** 0.5


def random_hadamard(n: int, seed: int) -> torch.Tensor:
    """``diag(s) · H_n / √n`` with signs ``s = ±1`` drawn from ``seed`` (QuaRot's randomized Hadamard, as SpinQuant's and
    compressed-tensors' ``random_hadamard_matrix`` build it). The signs come first: ``x · diag(s) · H`` flips input
    channels before they are mixed, so each seed spreads them differently. Signs after the mix (``H · diag(s)``)
    would only flip output channels, which no symmetric grid sees."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64) * 2 - 1
    return signs.to(torch.float64)[:, None] * hadamard(n)
