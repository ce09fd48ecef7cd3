"""Tests for compress.quantizers.hessian_factor against the textbook definition (float64 Cholesky of the explicit
inverse) and for its promise: the same bits whatever the thread count."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers import hessian_factor
from compress.quantizers.hessian_factor import BLOCK, WIDE_BLOCK, inverse_hessian_factor, upper_inverse_factor


def spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + 64, n, generator=g) @ (torch.eye(n) + 0.3 * torch.randn(n, n, generator=g) / n**0.5)
    h = x.t() @ x / x.shape[0]
    return h + 0.01 * h.diagonal().mean() * torch.eye(n)


@pytest.fixture
def wide_from_256(monkeypatch):
    """`WIDE_BLOCK`-row steps from 256 columns on (they start at 4096): the wide path on small matrices."""
    monkeypatch.setattr(hessian_factor, "WIDE", 256)


@pytest.mark.parametrize("n", [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK - 5])
def test_is_the_upper_cholesky_factor_of_the_inverse(n):
    h = spd(n, seed=n)
    u = upper_inverse_factor(h.clone())
    textbook = torch.linalg.cholesky(torch.linalg.inv(h.double()), upper=True)
    assert torch.equal(u, u.triu()) and (u.diagonal() > 0).all()
    assert (u.double() - textbook).abs().max() <= 2e-6 * textbook.abs().max()


def test_wide_matrices_step_by_wide_blocks(wide_from_256):
    n = 3 * WIDE_BLOCK + 37
    assert hessian_factor.block_rows(n) == WIDE_BLOCK and hessian_factor.block_rows(255) == BLOCK
    test_is_the_upper_cholesky_factor_of_the_inverse(n)
    test_the_same_bits_at_every_thread_count(n)


def test_the_same_bits_at_every_thread_count(n: int = 5 * BLOCK + 37):
    h = spd(n, seed=1)
    threads = torch.get_num_threads()
    try:
        factors = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            factors.append(upper_inverse_factor(h.clone()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(factors[0], f) for f in factors[1:])


def test_not_positive_definite_is_none_and_damping_escalates():
    h = spd(2 * BLOCK + 3, seed=2)
    h[200, 200] = -1.0  # in the second diagonal block: its Schur complement fails
    assert upper_inverse_factor(h.clone()) is None
    u, damp, lam, retries = inverse_hessian_factor(h.clone(), 1e-6, 8)
    assert retries > 0 and damp == pytest.approx(1e-6 * 10**retries) and torch.isfinite(u).all()
