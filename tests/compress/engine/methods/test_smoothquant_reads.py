"""SmoothQuant reads only what it uses (`Method.layer_needs`): with dynamic activation scales, the inputs of the layers
it smooths (those a norm feeds), so its statistics pass ends at the up projection's call (the reference: the same run
reading every layer, as before `layer_needs` existed, the same bits); before GPTQ its groups ride GPTQ's pass
(`Method.producers`), checked against the smoothing recomputed with transformers."""

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


def test_dynamic_scales_read_only_the_smoothed_layers(tmp_path, tiny_tokenizer, monkeypatch):
    stages = [{"method": "smoothquant"}]
    model_dir = save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=1), tmp_path / "in", tiny_tokenizer)
    counts = Counter()
    ours = _run(model_dir, tmp_path / "ours", stages, counts, monkeypatch)
    # the call-order sample runs the block once; the one statistics pass stops at up_proj's call (gate/up are the
    # last norm-fed layers), so o_proj is computed there but neither up_proj nor down_proj; one block: no propagation
    assert counts == {"o_proj called": 2, "o_proj computed": 2, "up_proj called": 2, "up_proj computed": 1,
                      "down_proj called": 1, "down_proj computed": 1}
    monkeypatch.setattr(SmoothQuant, "layer_needs", Method.layer_needs)  # every layer's input read, as before
    _same_bits(ours, _run(model_dir, tmp_path / "every", stages, monkeypatch=monkeypatch))


def _norm_output_absmax(model, norm: str, ids: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """max |x| per channel of block 0's ``norm`` output over ``ids`` (with ``weight`` in place of the norm's own)."""
    module = model.model.layers[0].get_submodule(norm)
    if weight is not None:
        module.weight.data = weight.clone()
    seen = []
    handle = module.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().abs().amax(dim=(0, 1))))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("memory", [None, 1], ids=["one-pass", "pass-by-pass"])
def test_smoothing_rides_gptqs_pass(memory, tmp_path, tiny_tokenizer, monkeypatch):
    """SmoothQuant then GPTQ: no statistics pass of SmoothQuant's own; each norm is smoothed as the pass reaches it,
    from its output there: the attention's norm from the block's input, the MLP's from the attention GPTQ has
    already quantized. The reference recomputes both with transformers: the input norm on the input model, the
    post-attention norm (its original weight) on the output model, whose attention is the quantized one; each norm
    must then be its original weight divided by SmoothQuant's factors (alpha 0.8) from that range and the original
    readers' weights. Pass by pass (no memory for the one pass) each smoothing has a pass up to its readers."""
    from transformers import AutoModelForCausalLM

    from compress.checkpoints.calibration import load_calibration
    from compress.engine.block_engine import Engine
    from compress.quantizers.smoothquant import smoothing_scales

    model_dir = save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=1), tmp_path / "in", tiny_tokenizer)
    passes = []
    monkeypatch.setattr(Engine, "_run_until_called", lambda self, *a, run=Engine._run_until_called: (passes.append(a[2]), run(self, *a))[1])
    recipe = {"model": model_dir, "output": {"path": tmp_path / "out", "format": "fake"},
              "calibration": {"path": CALIB_TEXT, "samples": 4, "seq_len": 32, "batch_size": 2,
                              **({"activation_memory": memory} if memory else {})},
              "stages": [{"method": "smoothquant", "quantize_weights": False}, {"method": "gptq", "scheme": "w8a8-int8"}]}
    run_recipe(parse_recipe(recipe))
    if memory is None:
        assert passes == []  # the one pass read everything
    else:  # before q/k/v's pass and before gate/up's, a pass up to the smoothed readers
        assert [sorted(n.rsplit(".", 1)[1] for n in p) for p in passes] == [
            ["k_proj", "q_proj", "v_proj"], ["k_proj", "q_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"],
            ["gate_proj", "up_proj"], ["down_proj"]]
    ids = load_calibration(CALIB_TEXT, tiny_tokenizer, 4, 32)
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    layer = original.model.layers[0]
    smoothed = {n: p.detach().clone() for n, p in out.model.layers[0].named_parameters() if "norm" in n}
    attn_range = _norm_output_absmax(original, "input_layernorm", ids)
    mlp_range = _norm_output_absmax(out, "post_attention_layernorm", ids, layer.post_attention_layernorm.weight.data)
    for norm, act_range, readers in [
        ("input_layernorm", attn_range, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
        ("post_attention_layernorm", mlp_range, [layer.mlp.gate_proj, layer.mlp.up_proj]),
    ]:
        scales = smoothing_scales(act_range, [m.weight.data for m in readers], 0.8)
        expected = layer.get_submodule(norm).weight.data / scales
        torch.testing.assert_close(smoothed[f"{norm}.weight"], expected, rtol=2e-4, atol=0, msg=norm)


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
