"""compress.quantizers.cayley: the step keeps rotations orthogonal, agrees with the paper's fixed-point iteration and
with the Riemannian gradient to first order, and solves orthogonal Procrustes problems (closed form: SVD)."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.cayley import cayley_sgd


def _orthogonal(n: int, seed: int, det: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.sign(torch.linalg.det(q)) != det:
        q[:, 0] = -q[:, 0]
    return q


def _procrustes(n: int = 16, seed: int = 0):
    """``min ‖A R − B‖_F`` over orthogonal R: the answer ``U Vᵀ`` for ``Aᵀ B = U Σ Vᵀ``, and a start of its det."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(64, n, generator=g, dtype=torch.float64)
    b = a @ _orthogonal(n, seed + 1) + 0.3 * torch.randn(64, n, generator=g, dtype=torch.float64)
    u, _, vt = torch.linalg.svd(a.T @ b)
    best = u @ vt
    return a, b, best, _orthogonal(n, seed + 2, float(torch.sign(torch.linalg.det(best))))


def _gradient(a, b, r):
    return a.T @ (a @ r - b)  # of ½‖A R − B‖²


def test_orthogonal_after_many_steps_in_float64():
    x, g = _orthogonal(48, 0), torch.Generator().manual_seed(1)
    state = None
    for _ in range(2000):
        x, state = cayley_sgd(x, torch.randn(48, 48, generator=g, dtype=torch.float64), lr=1.5, momentum=0.9, state=state)
    assert (x.T @ x - torch.eye(48, dtype=torch.float64)).abs().max() < 1e-12


def test_a_stack_steps_each_rotation_apart():
    x = torch.stack([_orthogonal(8, 0), _orthogonal(8, 1)])
    grad = torch.stack([torch.ones(8, 8, dtype=torch.float64), 5 * torch.eye(8, dtype=torch.float64).flip(0)])
    stacked, _ = cayley_sgd(x, grad, lr=0.1)
    for i in range(2):
        assert torch.allclose(stacked[i], cayley_sgd(x[i], grad[i], lr=0.1)[0], atol=1e-14)


def test_the_closed_form_is_the_papers_fixed_point_iteration():
    """Algorithm 1's ``Y ← X + α/2 W (X + Y)`` iterated to convergence, from its own W and α (square X: Ŵ = ½ M Xᵀ)."""
    x = _orthogonal(12, 3)
    grad = torch.randn(12, 12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    m = -grad
    w = 0.5 * (m @ x.T - x @ m.T)
    alpha = min(0.2, 1 / float(w.abs().sum(dim=0).max()))
    y = x + alpha * (w @ x)
    for _ in range(200):
        y = x + alpha / 2 * w @ (x + y)
    assert torch.allclose(cayley_sgd(x, grad, lr=0.2)[0], y, atol=1e-12)


def test_a_small_step_follows_the_riemannian_gradient():
    """To first order the step is ``−α ½ (G − X Gᵀ X)`` (the gradient's projection on the tangent space at X)."""
    x = _orthogonal(10, 5)
    grad = torch.randn(10, 10, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    lr = 1e-6
    expected = x - lr * 0.5 * (grad - x @ grad.T @ x)
    assert (cayley_sgd(x, grad, lr=lr)[0] - expected).abs().max() < 1e-10


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_it_solves_orthogonal_procrustes(momentum):
    a, b, best, x = _procrustes()
    start = float(torch.linalg.norm(a @ x - b))
    state = None
    for _ in range(400):
        x, state = cayley_sgd(x, _gradient(a, b, x), lr=0.01, momentum=momentum, state=state)
    assert torch.allclose(x, best, atol=1e-6)
    assert float(torch.linalg.norm(a @ x - b)) < start
