"""The asymmetric target against a textbook ridge least-squares solve and the objective's decomposition."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.asymmetric import asymmetric_target


def problem(out=12, inp=20, n=300, drift=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g)
    X_f = torch.randn(n, inp, generator=g) * torch.linspace(0.2, 2.0, inp)  # tokens as rows
    X_q = X_f + drift * torch.randn(n, inp, generator=g)  # the compressed model's inputs of the same tokens
    H = 2.0 / n * X_q.t() @ X_q
    D = 2.0 / n * (X_f - X_q).t() @ X_q
    return W, X_f, X_q, H, D


def ridge_reference(W, X_f, X_q, lam):
    """argmin_Q ‖X_f Wᵀ − X_q Qᵀ‖² + lam ‖Q − W‖², in float64 by `lstsq` of the stacked system."""
    inp = W.shape[1]
    A = torch.cat([X_q.double(), lam**0.5 * torch.eye(inp, dtype=torch.float64)])
    B = torch.cat([X_f.double() @ W.double().t(), lam**0.5 * W.double().t()])
    return torch.linalg.lstsq(A, B).solution.t()


@pytest.mark.parametrize("damp", [1e-8, 0.01, 0.5])
def test_target_is_the_ridge_least_squares_solution(damp):
    W, X_f, X_q, H, D = problem()
    n = X_q.shape[0]
    lam = damp * float(torch.diagonal(H).mean()) * n / 2  # H's damping in the unscaled sums
    expected = ridge_reference(W, X_f, X_q, lam)
    got = asymmetric_target(W, H, D, damp)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_objective_splits_into_the_target_residual_and_gptq_proxy():
    """‖W X_f − Q X_q‖² = ‖W X_f − W* X_q‖² + (n/2) tr((W* − Q) H (W* − Q)ᵀ) for any Q (orthogonal residual)."""
    W, X_f, X_q, H, D = problem(seed=1)
    n = X_q.shape[0]
    target = asymmetric_target(W, H, D, 1e-9).double()
    Xf, Xq, Hd = X_f.double(), X_q.double(), H.double()
    for seed in range(3):
        Q = W.double() + 0.2 * torch.randn(W.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        whole = ((Xf @ W.double().t() - Xq @ Q.t()) ** 2).sum()
        residual = ((Xf @ W.double().t() - Xq @ target.t()) ** 2).sum()
        proxy = n / 2 * torch.trace((target - Q) @ Hd @ (target - Q).t())
        torch.testing.assert_close(whole, residual + proxy, rtol=1e-5, atol=1e-6)


def test_no_drift_keeps_the_weight_and_inputs_stay_untouched():
    W, X_f, X_q, H, D = problem(drift=0.0)
    assert torch.count_nonzero(D) == 0
    copies = [t.clone() for t in (W, H, D)]
    assert torch.equal(asymmetric_target(W, H, D, 0.01), W)
    for before, after in zip(copies, (W, H, D)):
        assert torch.equal(before, after)


def test_target_undoes_a_known_input_distortion():
    """If the compressed model feeds x_q = x_f · A (a fixed mix of channels), the best layer is W A⁻ᵀ:
    with enough tokens and little damping the target reproduces W x_f from x_q exactly."""
    W, X_f, _, _, _ = problem(drift=0.0, seed=2)
    A = torch.eye(20) + 0.1 * torch.randn(20, 20, generator=torch.Generator().manual_seed(3))
    X_q = X_f @ A
    n = X_q.shape[0]
    H, D = 2.0 / n * X_q.t() @ X_q, 2.0 / n * (X_f - X_q).t() @ X_q
    target = asymmetric_target(W, H, D, 1e-9)
    torch.testing.assert_close(X_q @ target.t(), X_f @ W.t(), rtol=1e-3, atol=1e-3)


def test_dead_inputs_and_bad_shapes():
    W, X_f, X_q, H, D = problem()
    X_q[:, 3] = 0  # an input the compressed model never activates
    n = X_q.shape[0]
    H, D = 2.0 / n * X_q.t() @ X_q, 2.0 / n * (X_f - X_q).t() @ X_q
    assert torch.isfinite(asymmetric_target(W, H, D, 0.01)).all()
    with pytest.raises(ValueError, match="does not match"):
        asymmetric_target(W, H, D[:5], 0.01)
    with pytest.raises(ValueError, match="NaN"):
        asymmetric_target(W, H, torch.full_like(D, float("nan")), 0.01)
