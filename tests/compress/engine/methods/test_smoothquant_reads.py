"""SmoothQuant's statistics pass reads only what the method uses (`Method.layer_needs`): with dynamic activation
scales, the inputs of the layers it smooths (those a norm feeds), so the pass ends at the up projection's call.
The reference is the same run reading every layer, as before `layer_needs` existed: the output must be the same
bit for bit."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from compress.engine.methods.base import Method
from compress.engine.methods.smoothquant import SmoothQuant
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, save_random_model, tiny_llama_config


def _run(model_dir, out, stages, counts: Counter | None = None, monkeypatch=None):
    if counts is not None:  # count each layer's calls and computations during the run
        import compress.run.compression as compression

        opened = compression.open_model

        def counting_open(*args, **kwargs):
            handle = opened(*args, **kwargs)
            for name, module in handle.model.named_modules():
                if name.endswith(("up_proj", "down_proj", "o_proj")):
                    short = name.rsplit(".", 1)[1]
                    module.register_forward_pre_hook(lambda _m, _a, s=short: counts.update([s + " called"]))
                    module.register_forward_hook(lambda _m, _a, _o, s=short: counts.update([s + " computed"]))
            return handle

        monkeypatch.setattr(compression, "open_model", counting_open)
    recipe = {"model": model_dir, "stages": stages, "calibration": {"path": CALIB_TEXT, "samples": 4, "seq_len": 32},
              "output": {"path": out, "format": "fake"}}
    run_recipe(parse_recipe(recipe))
    return load_file(out / "model.safetensors")


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8) if a[name].is_floating_point() else a[name],
                           b[name].view(torch.uint8) if b[name].is_floating_point() else b[name]), name


@pytest.mark.parametrize("stages", [
    [{"method": "smoothquant"}],
    [{"method": "smoothquant", "quantize_weights": False}, {"method": "gptq", "scheme": "w8a8-int8"}],
], ids=["smoothquant", "then-gptq"])
def test_dynamic_scales_read_only_the_smoothed_layers(stages, tmp_path, tiny_tokenizer, monkeypatch):
    model_dir = save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=1), tmp_path / "in", tiny_tokenizer)
    counts = Counter()
    ours = _run(model_dir, tmp_path / "ours", stages, counts, monkeypatch)
    if len(stages) == 1:
        # the call-order sample runs the block once; the one statistics pass stops at up_proj's call (gate/up are the
        # last norm-fed layers), so o_proj is computed there but neither up_proj nor down_proj; one block: no propagation
        assert counts == {"o_proj called": 2, "o_proj computed": 2, "up_proj called": 2, "up_proj computed": 1,
                          "down_proj called": 1, "down_proj computed": 1}
    monkeypatch.setattr(SmoothQuant, "layer_needs", Method.layer_needs)  # every layer's input read, as before
    _same_bits(ours, _run(model_dir, tmp_path / "every", stages, monkeypatch=monkeypatch))


def test_static_scales_read_every_layer(tmp_path, tiny_tokenizer, monkeypatch):
    model_dir = save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=1), tmp_path / "in", tiny_tokenizer)
    counts = Counter()
    _run(model_dir, tmp_path / "out", [{"method": "smoothquant", "activations": "tensor"}], counts, monkeypatch)
    assert counts["down_proj called"] == 2  # the sample's call and the statistics pass's, which reads its input


def test_plain_w8a8_reads_nothing(tmp_path, tiny_tokenizer, monkeypatch):
    """Without smoothing and with dynamic scales nothing of the inputs is used: no statistics pass runs."""
    model_dir = save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=1), tmp_path / "in", tiny_tokenizer)
    counts = Counter()
    _run(model_dir, tmp_path / "out", [{"method": "smoothquant", "smooth": False}], counts, monkeypatch)
    assert counts["o_proj called"] == 1  # the call-order sample only
