"""AWQ and SmoothQuant through the engine: Llama-, OPT- and GPT-2-style blocks, exact folding, W8A8 eval."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig, PhiConfig

from compress.checkpoints.loading import install_activation_quant, load_model
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, save_random_model, tiny_llama_config
from references import one_line_error


def configs(vocab: int):
    return {
        "llama": tiny_llama_config(vocab, num_key_value_heads=4),
        "opt": OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                         word_embed_proj_dim=64, max_position_embeddings=256),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, bos_token_id=0, eos_token_id=0),
    }


def _run(model_dir, out, stage, fmt="fake"):
    recipe = {
        "model": model_dir,
        "stages": [stage],
        "calibration": {"path": CALIB_TEXT, "samples": 4, "seq_len": 64},
        "output": {"path": out, "format": fmt},
    }
    return run_recipe(parse_recipe(recipe))


def _logits(path, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_smoothing_without_rounding_keeps_logits(arch, tmp_path, tiny_tokenizer):
    model_dir = save_random_model(configs(len(tiny_tokenizer))[arch], tmp_path / arch, tiny_tokenizer)
    _run(model_dir, tmp_path / "out", {"method": "smoothquant", "quantize_weights": False, "alpha": 0.8})
    ids = torch.randint(0, len(tiny_tokenizer), (2, 32))
    before, after = _logits(model_dir, ids), _logits(tmp_path / "out", ids)  # plain transformers: no A8 hooks
    assert ((before - after).abs().max() / before.abs().max()).item() < 1e-4
    norms = [n for n, _ in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters() if "norm" in n or "ln_" in n]
    changed = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(changed[n], original[n]) for n in norms)  # the scales went into the norms


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_awq_runs_and_reports_its_search(arch, tmp_path, tiny_tokenizer):
    model_dir = save_random_model(configs(len(tiny_tokenizer))[arch], tmp_path / arch, tiny_tokenizer)
    # the scale search on 2 of the 4 windows: each architecture's attention arguments cut to them
    result = _run(model_dir, tmp_path / "out", {"method": "awq", "bits": 4, "group_size": 32, "n_grid": 4, "clip_grid": 4, "search_tokens": 128})
    layers = {r.name: r.info for r in result.engine.layers}
    assert len(layers) == {"llama": 14, "opt": 12, "gpt2": 8}[arch]
    assert all("weight_rel_error" in info for info in layers.values())
    assert sum("alpha" in info for info in layers.values()) >= len(layers) // 2
    assert any("mean_clip" in info for info in layers.values())
    ids = torch.randint(0, len(tiny_tokenizer), (1, 16))
    assert torch.isfinite(_logits(tmp_path / "out", ids)).all()


def test_unmapped_architecture_is_a_clear_error(tmp_path, tiny_tokenizer):
    config = PhiConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4)
    model_dir = save_random_model(config, tmp_path / "phi", tiny_tokenizer)
    message = one_line_error(_run, model_dir, tmp_path / "out", {"method": "awq"})
    assert "no norm-to-linear mapping for model_type 'phi'" in message
    assert not (tmp_path / "out").exists()


def test_w8a8_output_records_activations_and_eval_quantizes_them(tmp_path, tiny_tokenizer):
    model_dir = save_random_model(configs(len(tiny_tokenizer))["llama"], tmp_path / "llama", tiny_tokenizer)
    _run(model_dir, tmp_path / "out", {"method": "smoothquant", "activations": "tensor"})
    record = json.loads((tmp_path / "out" / "config.json").read_text())["compression"]["stages"][0]
    assert record["activations"] == {"bits": 8, "granularity": "tensor", "dynamic": False, "symmetric": True}
    scales = record["activation_layers"]
    assert len(scales) == 14 and all(s > 0 for s in scales.values())
    model = load_model(tmp_path / "out", torch.device("cpu"))
    seen = {}
    name = "model.layers.0.mlp.down_proj"
    model.get_submodule(name).register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    with torch.no_grad():
        model(torch.randint(0, len(tiny_tokenizer), (1, 16)))
    codes = seen["x"] / scales[name]  # the hooked input sits on the int8 grid of its static scale
    assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127
    assert install_activation_quant(AutoModelForCausalLM.from_pretrained(model_dir), None) == 0


def test_smoothquant_then_gptq_keeps_int8_activations_when_packed(tmp_path, tiny_tokenizer):
    model_dir = save_random_model(configs(len(tiny_tokenizer))["llama"], tmp_path / "llama", tiny_tokenizer)
    recipe = {
        "model": model_dir,
        "stages": [{"method": "smoothquant", "quantize_weights": False}, {"method": "gptq", "bits": 8, "group_size": -1}],
        "calibration": {"path": CALIB_TEXT, "samples": 4, "seq_len": 64},
        "output": {"path": tmp_path / "out", "format": "compressed-tensors"},
    }
    run_recipe(parse_recipe(recipe))
    groups = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["config_groups"]
    (group,) = groups.values()
    assert group["format"] == "int-quantized"
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    model = load_model(tmp_path / "out", torch.device("cpu"))
    assert model.get_submodule("model.layers.1.mlp.down_proj").quantizes_input
