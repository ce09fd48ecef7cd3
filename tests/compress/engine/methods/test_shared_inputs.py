"""Layers fed the very same input (one statistics dict: q/k/v, gate/up) solved stacked by rows
(`Method.transform_shared`): the solvers' rows are independent given H, so the stack's slices are each layer
solved alone, bit for bit, with each layer's own figures; methods whose grids couple rows, or that keep per-layer
state from the solve, go one layer at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compress.engine.statistics import Stat
from compress.quantizers.gptq import GPTQConfig, gptq
from compress.quantizers.grid import QuantScheme
from compress.run.recipe import parse_recipe

COLS = 64


def build_method(stage: dict):
    (method,) = parse_recipe({"model": "m", "output": {"path": "o"}, "stages": [stage]}).methods()
    return method


def _stats(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, COLS, generator=g) @ (torch.eye(COLS) + 0.2 * torch.randn(COLS, COLS, generator=g))
    x[:, 5] = 0.0  # a dead input
    return {Stat.HESSIAN: 2 / 400 * x.T @ x, Stat.INPUT_ABSMAX: x.abs().amax(0)}


def _block(rows=(48, 16, 16, 40)):
    torch.manual_seed(3)
    layers = {name: nn.Linear(COLS, n, bias=False) for name, n in zip(("q", "k", "v", "o"), rows)}
    shared = _stats(1)
    return layers, {"q": shared, "k": shared, "v": shared, "o": _stats(2)}


def _one_by_one(method, layers, stats):
    return {name: method.transform_layer(name, layer.weight.detach().float(), stats[name]) for name, layer in layers.items()}


def _count_solves(method, monkeypatch) -> list[str]:
    calls = []
    solved = method.solved
    monkeypatch.setattr(method, "solved", lambda name, w, s: calls.append(name) or solved(name, w, s))
    return calls


SETTINGS = [
    {"method": "gptq", "bits": 4, "group_size": 16},
    {"method": "gptq", "bits": 3, "group_size": -1, "act_order": False, "mse": False},
    {"method": "gptq", "bits": 8, "group_size": -1, "activations": "int8-tensor"},
    {"method": "gptq", "bits": 4, "group_size": 16, "asymmetric": True},
    {"method": "sparsegpt", "pattern": "2:4", "bits": 4, "group_size": 16},
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_stacked_layers_are_each_solved_alone(settings, monkeypatch):
    method = build_method(settings)
    layers, stats = _block()
    if settings.get("asymmetric"):
        g = torch.Generator().manual_seed(9)
        for s in {id(v): v for v in stats.values()}.values():
            s[Stat.INPUT_DRIFT] = 0.01 * torch.randn(COLS, COLS, generator=g)
    alone = _one_by_one(method, layers, stats)
    method.take_outcomes()
    recorded = dict(method.__dict__.get("input_scales", {}))
    calls = _count_solves(method, monkeypatch)
    reports = method.transform_block(None, layers, stats)

    assert calls == ["q, k, v", "o"]  # the shared set in one solve: the test can fail
    assert [r.name for r in reports] == list(layers)
    kept = method.take_outcomes()
    for report, (name, layer) in zip(reports, layers.items()):
        expected = alone[name]
        assert report.shape == tuple(layer.weight.shape)
        assert torch.equal(layer.weight.detach(), expected.weight.to(layer.weight.dtype)), name
        for field in ("codes", "scale", "zero"):
            assert torch.equal(getattr(kept[name].quant, field), getattr(expected.quant, field)), (name, field)
        assert report.info.keys() == expected.info.keys()
        for key, value in expected.info.items():  # each layer's own figures, not the stack's
            assert report.info[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), (name, key)
        assert kept[name].energy == pytest.approx(expected.energy, rel=1e-6)
    assert method.__dict__.get("input_scales", {}) == recorded  # W8A8: a scale per layer name, none for the stack


def test_the_stacks_slices_are_the_textbook_solve_of_each_layer():
    """Against the pure algorithm, not the method: GPTQ of each weight alone with the shared H."""
    method = build_method({"method": "gptq", "bits": 4, "group_size": 16, "mse": False})
    layers, stats = _block()
    config = GPTQConfig(QuantScheme(4, True, 16), act_order=True)
    reference = {n: gptq(layers[n].weight.detach(), stats["q"][Stat.HESSIAN], config) for n in ("q", "k", "v")}
    method.transform_block(None, layers, stats)
    kept = method.take_outcomes()
    for name, result in reference.items():
        assert torch.equal(layers[name].weight.detach(), result.weight), name
        assert torch.equal(kept[name].quant.codes, result.codes), name
        assert kept[name].info["error"] == pytest.approx(result.stats["error"], rel=1e-6), name


def test_stacks_stay_within_the_size_limit(monkeypatch):
    method = build_method({"method": "gptq", "bits": 4, "group_size": 16})
    monkeypatch.setattr(type(method), "stack_elements", 56 * COLS)  # q (48 rows) then k + v (32): q + k is 64
    layers, stats = _block()
    alone = _one_by_one(method, layers, stats)
    calls = _count_solves(method, monkeypatch)
    method.transform_block(None, layers, stats)
    assert calls == ["q", "k, v", "o"]
    for name, layer in layers.items():
        assert torch.equal(layer.weight.detach(), alone[name].weight), name


@pytest.mark.parametrize("settings", [
    {"method": "gptq", "scheme": "nvfp4a16"},  # one global scale from the whole weight: rows coupled
    {"method": "sparsegpt", "sparsity": 0.5},  # the unstructured mask ranks all rows together
])
def test_methods_coupling_rows_solve_one_layer_at_a_time(settings, monkeypatch):
    method = build_method(settings)
    layers, stats = _block()
    calls = _count_solves(method, monkeypatch)
    method.transform_block(None, layers, stats)
    assert calls == ["q", "k", "v", "o"]
