"""One step of Cayley SGD on the orthogonal group: gradient descent that keeps a rotation a rotation.

Li, Fuxin and Todorovic, "Efficient Riemannian Optimization on the Stiefel Manifold via the Cayley Transform"
(ICLR 2020, arXiv:2002.01113), Algorithm 1 (Cayley SGD with momentum), as SpinQuant (Liu et al. 2024,
arXiv:2405.16406) trains its rotations R1 and R2 with it.

For ``X [n, n]`` with ``XᵀX = I``, the Euclidean gradient ``G = ∂f/∂X [n, n]``, momentum ``β`` and the learning
rate ``l``:

    M ← β M − G                            (the momentum, a descent direction)
    Ŵ = M Xᵀ − ½ X (Xᵀ M Xᵀ)               (for square X: ½ M Xᵀ)
    W = Ŵ − Ŵᵀ                              (skew-symmetric: the direction projected on the tangent space)
    M ← W X                                 (the momentum carried on the tangent space)
    α = min(l, 1 / ‖W‖₁)                    (‖·‖₁ the largest column sum of |W|: the paper's step bound, q = ½)
    X ← (I − α/2 W)⁻¹ (I + α/2 W) X         (the Cayley transform of αW)

The Cayley transform of a skew-symmetric matrix is orthogonal, so ``X`` stays orthogonal to rounding at every
step; it is solved here in closed form (one linear solve), which the paper's fixed-point iteration
``Y ← X + α/2 W (X + Y)`` approximates. To first order ``X ← X − α ½ (G − X Gᵀ X)``: a step along the Riemannian
gradient. Shapes: ``[n, n]`` or a stack ``[..., n, n]`` of independent rotations (one step size each); computed
in the dtype of ``X`` (float64 keeps ``XᵀX = I`` to ~1e-13 over thousands of steps). Pure: inputs are not modified.
"""

from __future__ import annotations

import torch


def cayley_sgd(x: torch.Tensor, grad: torch.Tensor, lr: float, momentum: float = 0.0,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Cayley SGD step from the orthogonal ``x [..., n, n]`` along its Euclidean gradient ``grad``. ``state``:
    the momentum ``M`` the last step returned (None: zero). Returns the new ``x`` and ``M``."""
    g = grad.to(x.dtype)
    m = -g if state is None else momentum * state - g
    xt = x.transpose(-1, -2)
    w_hat = m @ xt - 0.5 * x @ (xt @ m @ xt)
    w = w_hat - w_hat.transpose(-1, -2)
    m = w @ x
    norm_one = w.abs().sum(dim=-2).amax(dim=-1)  # the largest column sum of each |W|
    alpha = torch.clamp(1.0 / (norm_one + 1e-8), max=lr)[..., None, None]
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    x = torch.linalg.solve(eye - 0.5 * alpha * w, (eye + 0.5 * alpha * w) @ x)
    return x, m
