"""SmoothQuant's scales against the paper's formula and its balancing property."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.smoothquant import smoothing_scales


def test_scales_follow_the_formula_per_channel():
    g = torch.Generator().manual_seed(0)
    act = torch.rand(8, generator=g) * 30
    w1, w2 = torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g)
    s = smoothing_scales(act, [w1, w2], alpha=0.75)
    for j in range(8):
        w_max = max(w1[:, j].abs().max().item(), w2[:, j].abs().max().item())
        assert s[j].item() == pytest.approx(act[j].item() ** 0.75 / w_max**0.25, rel=1e-5)


def test_half_alpha_balances_activation_and_weight_ranges():
    act = torch.tensor([100.0, 1.0, 0.5, 4.0])
    w = torch.tensor([[0.1, 2.0, -0.3, 1.0], [-0.2, 0.5, 0.1, -3.0]])
    s = smoothing_scales(act, [w], alpha=0.5)
    assert torch.allclose(act / s, (w * s).abs().amax(dim=0), rtol=1e-5)  # max|X_j/s_j| == max|W_j s_j|


def test_bad_alpha_is_rejected():
    with pytest.raises(ValueError):
        smoothing_scales(torch.ones(2), [torch.ones(1, 2)], alpha=1.5)
