"""AWQ's output error of a group of plain layers from one Gram matrix, against the layers' own outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from compress.checkpoints.model_io import get_weight, set_weight
from compress.engine.methods.awq import _LinearOutputError, _output_error
from compress.engine.ranks import Ranks


def _weights(layers):
    """What the AWQ method hands over: copies of the layers' weights as ``[out, in]``, in their dtype."""
    return [get_weight(m).detach().clone() for m in layers]


def _forward_error(calls, layers, candidates) -> float:
    """The textbook form: mean squared difference of the layers' outputs under the candidates."""
    originals = [get_weight(m).detach().clone() for m in layers]
    run = lambda args, kwargs: torch.cat([m(*args) for m in layers], dim=-1)  # noqa: E731
    recorded = [(a, k, run(a, k)) for a, k, _ in calls]
    for module, w in zip(layers, candidates):
        set_weight(module, w)
    value = _output_error(recorded, run, Ranks())
    for module, w in zip(layers, originals):
        set_weight(module, w)
    return value


def _exact_error(calls, layers, candidates) -> float:
    """Float64 outputs of the weights each layer would hold (cast to its dtype), minus the original ones."""
    total, count = 0.0, 0
    for (x,), _, _ in calls:
        x = x.double().reshape(-1, x.shape[-1])
        for module, w in zip(layers, candidates):
            delta = w.to(get_weight(module).dtype).double() - get_weight(module).double()
            total += (x @ delta.t()).square().sum().item()
            count += x.shape[0] * delta.shape[0]
    return total / count


def _calls(width: int, shapes, generator):
    outlier = torch.ones(width)
    outlier[::7] = 30.0  # AWQ's salient channels: a few large activations make the Gram matrix ill-conditioned
    return [((torch.randn(*shape, width, generator=generator) * outlier,), {}, None) for shape in shapes]


@pytest.mark.parametrize("kind", ["linear", "two linears", "conv1d", "bfloat16"])
def test_gram_error_is_the_layers_output_error(kind):
    g = torch.Generator().manual_seed(0)
    width = 96
    if kind == "conv1d":
        layers = [Conv1D(40, width)]
    elif kind == "two linears":
        layers = [nn.Linear(width, 40), nn.Linear(width, 24, bias=False)]
    else:
        layers = [nn.Linear(width, 40)]
    if kind == "bfloat16":
        layers = [m.to(torch.bfloat16) for m in layers]
    calls = _calls(width, [(2, 33), (1, 50)], g)
    if kind == "bfloat16":
        calls = [((a[0].bfloat16(),), k, r) for a, k, r in calls]
    gram = _LinearOutputError(calls, _weights(layers), Ranks())
    for step in (0.0, 1e-3, 0.05):
        candidates = [get_weight(m).float() + step * torch.randn(get_weight(m).shape, generator=g) for m in layers]
        # bf16 outputs round their own difference: there the truth is float64 outputs of the bf16 weights as set
        expected = _exact_error(calls, layers, candidates) if kind == "bfloat16" else _forward_error(calls, layers, candidates)
        assert gram(candidates) == pytest.approx(expected, rel=1e-4, abs=1e-9)


def test_gram_error_orders_close_candidates_as_the_outputs_do():
    """The scale search keeps the smallest error: candidates 1 % apart must rank the same both ways."""
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(64, 32)
    calls = _calls(64, [(4, 64)], g)
    gram = _LinearOutputError(calls, _weights([layer]), Ranks())
    direction = torch.randn(32, 64, generator=g) * 1e-2
    candidates = [[layer.weight.detach() + direction * (1 + 0.01 * i)] for i in range(-3, 4)]
    by_gram = sorted(range(7), key=lambda i: gram(candidates[i]))
    by_outputs = sorted(range(7), key=lambda i: _forward_error(calls, [layer], candidates[i]))
    assert by_gram == by_outputs == [0, 1, 2, 3, 4, 5, 6]


def test_a_layer_without_calls_has_no_error():
    """An expert no calibration token was routed to."""
    layer = nn.Linear(16, 8)
    assert _LinearOutputError([], _weights([layer]), Ranks())([layer.weight.detach() + 1]) == 0.0
