"""Int8 activation fake-quantization against a per-element reference."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.activations import ActGranularity, ActivationScheme, quantize_activations, static_scale


def test_per_token_dynamic_matches_elementwise_reference():
    x = torch.randn(2, 3, 16) * torch.tensor([1.0, 10.0, 0.01]).view(1, 3, 1)
    got = quantize_activations(x, ActivationScheme())
    for b in range(2):
        for t in range(3):
            s = x[b, t].abs().max().item() / 127
            for j in range(16):
                expected = max(-127, min(127, round(x[b, t, j].item() / s))) * s
                assert got[b, t, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_static_per_tensor_saturates_beyond_the_calibrated_range():
    scheme = ActivationScheme(8, ActGranularity.TENSOR, dynamic=False)
    scale = static_scale(torch.tensor([2.0, 1.0]), scheme)
    x = torch.tensor([[0.5, -1.0, 3.0, -5.0]])
    got = quantize_activations(x, scheme, scale)
    s = 2.0 / 127
    assert torch.allclose(got, torch.tensor([[round(0.5 / s) * s, round(-1.0 / s) * s, 2.0, -2.0]]), atol=1e-6)


def test_inconsistent_schemes_are_rejected():
    with pytest.raises(ValueError):
        ActivationScheme(8, ActGranularity.TOKEN, dynamic=False)
    with pytest.raises(ValueError):
        quantize_activations(torch.ones(1, 2), ActivationScheme(8, ActGranularity.TENSOR, dynamic=False))
