"""AWQ's scale and clipping searches against slow textbook versions and their published properties."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.awq import AWQConfig, candidate_scales, search_clip, search_scales
from compress.quantizers.grid import QuantScheme, fake_quantize


def _salient_layer(seed: int = 0, in_features: int = 64, out_features: int = 32, tokens: int = 256):
    """Activations with a few large channels, as in LLMs (AWQ §3.1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g)
    x[:, :4] *= 20.0
    w = torch.randn(out_features, in_features, generator=g)
    return x, w


def _output_loss(x, w):
    reference = x @ w.t()
    return lambda candidates: (x @ candidates[0].t() - reference).square().mean().item()


def test_scales_are_normalized_and_alpha_zero_is_rtn():
    x_mean = torch.rand(16) + 0.1
    s = candidate_scales(x_mean, 0.7)
    assert torch.isclose(s.max() * s.min(), torch.tensor(1.0), rtol=1e-5)
    assert torch.allclose(candidate_scales(x_mean, 0.0), torch.ones(16))


def test_scale_search_picks_the_grid_minimum_and_beats_rtn_on_salient_channels():
    x, w = _salient_layer()
    config = AWQConfig(QuantScheme(3, True, 32), n_grid=10)
    loss = _output_loss(x, w)
    result = search_scales(x.abs().mean(dim=0), [w], loss, config)
    # Slow reference: every alpha of the grid, evaluated from scratch.
    losses = []
    for i in range(10):
        s = x.abs().mean(dim=0).pow(i / 10)
        s = s / (s.max() * s.min()).sqrt()
        losses.append(loss([fake_quantize(w * s, config.scheme) / s]))
    assert result.alpha == losses.index(min(losses)) / 10
    assert abs(result.loss - min(losses)) <= 1e-6 * max(min(losses), 1e-12)
    assert result.rtn_loss == losses[0]
    assert result.loss < 0.8 * result.rtn_loss  # salient channels protected


def test_scale_search_does_not_modify_inputs():
    x, w = _salient_layer(1)
    before = w.clone()
    search_scales(x.abs().mean(dim=0), [w], _output_loss(x, w), AWQConfig(QuantScheme(4, True, 32), n_grid=4))
    assert torch.equal(w, before)


def _reference_clip(w, x, scheme, grid, max_shrink):
    """Column group by column group, row by row: the shrink with the lowest partial-output error."""
    width = scheme.group_width(w.shape[1])
    best = torch.ones(w.shape[0], w.shape[1] // width)
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // width):
            cols = slice(g * width, (g + 1) * width)
            target = x[:, cols] @ w[r, cols]
            errors = []
            for i in range(int(max_shrink * grid)):
                shrink = 1 - i / grid
                row = w[r : r + 1, cols]
                q = _fake_quant_clipped(row, QuantScheme(scheme.bits, scheme.symmetric, -1), shrink)
                errors.append(((x[:, cols] @ q[0] - target) ** 2).mean().item())
            best[r, g] = 1 - errors.index(min(errors)) / grid
    return best


def _fake_quant_clipped(row, scheme, shrink):
    from compress.quantizers.grid import compute_qparams, dequantize, quantize

    scale, zero = compute_qparams(row, scheme, shrink)
    return dequantize(quantize(row, scale, zero, scheme), scale, zero, scheme)


@pytest.mark.parametrize("tokens, group", [(64, 16), (16, -1)])  # groups narrower than the tokens (Gram), per channel
def test_clip_search_matches_slow_reference(tokens, group):
    x, w = _salient_layer(2, in_features=32, out_features=6, tokens=tokens)
    w[0, 3] = 8.0  # an outlier weight makes clipping worthwhile in that group
    for scheme in (QuantScheme(3, True, group), QuantScheme(4, False, group)):
        config = AWQConfig(scheme, clip_grid=10, max_shrink=0.5)
        got = search_clip(w, x, config, rows_per_batch=4)
        expected = _reference_clip(w, x, scheme, 10, 0.5)
        assert torch.equal(got, expected), (got, expected)
    assert (got < 1).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_clip_search_on_the_gpu_stays_there_and_agrees():
    """AWQ on CUDA once failed here: the shrink table was made on the CPU and met a CUDA weight."""
    x, w = _salient_layer(seed=5, in_features=64, out_features=16, tokens=32)
    config = AWQConfig(QuantScheme(4, False, 16), clip_grid=10, max_shrink=0.5)
    got = search_clip(w.cuda(), x.cuda(), config)
    assert got.device.type == "cuda"
    agree = (got.cpu() == search_clip(w, x, config)).float().mean().item()
    assert agree > 0.9  # the same choices, but where two candidates' errors tie within the GPU's rounding
