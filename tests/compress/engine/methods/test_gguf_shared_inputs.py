"""GPTQ in GGUF grids (`GGUFGPTQ`) with layers fed the very same input: those planned in one GGML type are solved
stacked by rows, and each layer's bytes and figures must be what solving it alone gives (against the method one
layer at a time, and against `gguf_gptq` itself)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from compress.engine.methods.gguf import GGUFGPTQ, GGUFGPTQMethodConfig
from compress.engine.statistics import Stat
from compress.formats.gguf.sizes import GGMLType
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, gguf_gptq

COLS = 256


def _stats(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(600, COLS, generator=g) @ (torch.eye(COLS) + 0.2 * torch.randn(COLS, COLS, generator=g))
    x[:, 7] = 0.0  # a dead input
    return {Stat.HESSIAN: 2 / 600 * x.T @ x}


def _block(rows=(48, 16, 16, 40)):
    torch.manual_seed(4)
    layers = {name: nn.Linear(COLS, n, bias=False) for name, n in zip(("q", "k", "v", "o"), rows)}
    shared = _stats(1)
    return layers, {"q": shared, "k": shared, "v": shared, "o": _stats(2)}


def _calls(method, monkeypatch) -> list[int]:
    import compress.engine.methods.gguf as module

    rows = []
    solve = module.gguf_gptq
    monkeypatch.setattr(module, "gguf_gptq", lambda w, h, c: rows.append(w.shape[0]) or solve(w, h, c))
    return rows


@pytest.mark.parametrize("types", [
    {"q": GGMLType.Q4_K, "k": GGMLType.Q4_K, "v": GGMLType.Q4_K, "o": GGMLType.Q6_K},
    {"q": GGMLType.Q8_0, "k": GGMLType.Q5_0, "v": GGMLType.Q8_0, "o": GGMLType.Q8_0},  # q and v stacked, k alone
])
def test_stacked_layers_are_each_solved_alone(types, monkeypatch):
    layers, stats = _block()
    alone = GGUFGPTQ(GGUFGPTQMethodConfig(compare_rtn=True), types)
    expected = {name: alone.transform_layer(name, layer.weight.detach().float(), stats[name]) for name, layer in layers.items()}
    method = GGUFGPTQ(GGUFGPTQMethodConfig(compare_rtn=True), types)
    rows = _calls(method, monkeypatch)
    reports = method.transform_block(None, layers, stats)

    same_type = types["k"] == types["q"]
    assert rows == ([80, 40] if same_type else [64, 16, 40])  # the test can fail: one solve per stack
    for report, (name, layer) in zip(reports, layers.items()):
        kind, data = method.encoded[name]
        assert kind == types[name] and data.shape[0] == layer.weight.shape[0]
        np.testing.assert_array_equal(data, alone.encoded[name][1], err_msg=name)
        assert torch.equal(layer.weight.detach(), expected[name].weight), name
        assert report.info.keys() == expected[name].info.keys()
        for key, value in expected[name].info.items():  # each layer's own figures, not the stack's
            assert report.info[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), (name, key)


def test_each_layers_bytes_are_gguf_gptq_of_that_layer():
    """Against the pure algorithm: `gguf_gptq` of each weight alone with the shared H."""
    layers, stats = _block()
    types = dict.fromkeys(layers, GGMLType.Q4_K)
    method = GGUFGPTQ(GGUFGPTQMethodConfig(compare_rtn=True), types)  # each layer's share of the stack's comparison too
    weights = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    reports = {r.name: r for r in method.transform_block(None, layers, stats)}
    for name in ("q", "k", "v"):
        result = gguf_gptq(weights[name], stats["q"][Stat.HESSIAN], GGUFGPTQConfig(GGMLType.Q4_K))
        np.testing.assert_array_equal(method.encoded[name][1], result.data, err_msg=name)
        assert torch.equal(layers[name].weight.detach(), result.weight), name
        for key in ("rel_error", "rtn_rel_error", "dead_columns"):
            assert reports[name].info[key] == pytest.approx(result.stats[key], rel=1e-6), (name, key)
