"""Calibrated KV-cache scales in a compression run, checked against their consumer: transformers +
compressed-tensors load the output, create their own k_scale/v_scale parameters (names, shapes, dtypes by
compressed-tensors' definitions), fill them from our tensors, and quantize the cache with them to the same
logits as our evaluator's simulation. Plus vLLM's naming rule and every bad input as one line."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import torch
from typer.testing import CliRunner

from compress.cli import app
from conftest import CALIB_TEXT, EVAL_TEXT

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def ct_on_transformers_5(monkeypatch):
    """compressed-tensors 0.20.1 finds cached attention by a ``past_key_value(s)`` forward argument, which
    transformers 5.x renamed ``cache``: without this shim it skips kv_cache_scheme and reports the scales
    as unexpected keys. The shim only teaches it the new name (same detection, same hook)."""
    import compressed_tensors.modeling.kvcache as ct_kv
    import compressed_tensors.quantization.lifecycle.apply as ct_apply
    import compressed_tensors.quantization.lifecycle.initialize as ct_init

    original = ct_init.is_cached_attention_module

    def is_cached(module):
        try:
            takes_cache = "cache" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            takes_cache = False
        return original(module) or (ct_init._is_attention_module(module) and takes_cache)

    def hook(module, args, kwargs):
        cache = getattr(module, ct_kv.KV_CACHE_ATTR)
        cache.add_past_key_values(kwargs.get("cache"))
        kwargs["cache"] = cache
        return args, kwargs

    monkeypatch.setattr(ct_apply, "is_cached_attention_module", is_cached)
    monkeypatch.setattr(ct_init, "is_cached_attention_module", is_cached)
    monkeypatch.setattr(ct_kv, "_kv_cache_attention_hook", hook)


def quantize(model, out, *extra):
    result = invoke("quantize", model, "-o", out, "--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "32", "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads((out / "config.json").read_text())


def stored(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(out / "model.safetensors").items() if k.endswith(("k_scale", "v_scale"))}


# vLLM's maybe_remap_kv_scale_name: checkpoint ``<attn>.k_scale`` becomes its parameter ``<attn>.attn.k_scale``
VLLM_DEFAULT_RULE = (r"\.([qkv])_scale$", r".attn.\1_scale")


@pytest.mark.parametrize("args,strategy", [(("--kv-cache", "fp8"), "tensor"), (("--kv-cache", "int8", "--kv-cache-strategy", "head"), "attn_head")])
def test_consumer_reads_the_scales(tiny_llama, tmp_path, ct_on_transformers_5, args, strategy):
    from compressed_tensors.quantization import QuantizationArgs
    from transformers import AutoModelForCausalLM

    from compress.checkpoints.loading import load_model
    from compress.eval.kv_cache import resolve_kv_cache, simulate_kv_cache

    out = tmp_path / "out"
    config = quantize(tiny_llama, out, "--bits", "4", "--group-size", "32", *args)
    scheme = config["quantization_config"]["kv_cache_scheme"]
    parsed = QuantizationArgs(**scheme)  # compressed-tensors' own validation
    assert str(getattr(parsed.strategy, "value", parsed.strategy)) == strategy and parsed.num_bits == 8 and parsed.symmetric and not parsed.dynamic
    assert config["compression"]["kv_cache"]["format"] == args[1]
    ours = stored(out)
    assert sorted(ours) == [f"model.layers.{i}.self_attn.{s}" for i in range(2) for s in ("k_scale", "v_scale")]
    for name, t in ours.items():
        assert re.sub(*VLLM_DEFAULT_RULE, name).endswith(".self_attn.attn." + name.rsplit(".", 1)[1])
        assert t.numel() == (2 if strategy == "attn_head" else 1)  # vLLM: [num_kv_heads] or one value

    consumer = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    params = dict(consumer.named_parameters())
    for name, t in ours.items():  # compressed-tensors created each parameter itself, then loaded ours into it
        assert params[name].shape == t.shape and params[name].dtype == t.dtype, name
        torch.testing.assert_close(params[name].data, t, rtol=0, atol=0)

    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    model = load_model(out, torch.device("cpu"))
    setting = resolve_kv_cache(out, model, None)  # the default: the checkpoint's own scales
    assert setting is not None and setting.scales is not None
    with torch.no_grad(), simulate_kv_cache(model, setting):
        simulated = model(ids, use_cache=False).logits
    with torch.no_grad():
        theirs = consumer(ids, use_cache=False).logits
        plain = model(ids, use_cache=False).logits
    torch.testing.assert_close(simulated, theirs, rtol=0, atol=1e-5)
    assert (plain - theirs).abs().max() > 1e-5  # the consumer did quantize its cache


def test_kv_only_recipe_writes_dense_weights(tiny_llama, tmp_path, ct_on_transformers_5):
    from transformers import AutoModelForCausalLM

    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe

    out = tmp_path / "kv-only"
    short = tmp_path / "eval.txt"
    short.write_text(EVAL_TEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    recipe = parse_recipe({
        "model": str(tiny_llama), "stages": [], "output": {"path": str(out)},
        "calibration": {"path": str(CALIB_TEXT), "samples": 4, "seq_len": 32},
        "kv_cache": {"format": "fp8"}, "evaluation": {"text": str(short), "ctx": 64},
    })
    result = run_recipe(recipe)
    assert result.evaluation.kv_cache == "fp8, calibrated per-tensor scales from the checkpoint"
    assert 0 < result.evaluation.kld < 0.01
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "dense" and qc["config_groups"] == {} and qc["kv_cache_scheme"]["type"] == "float"
    consumer = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(consumer.model.layers[0].self_attn.k_scale.data, stored(out)["model.layers.0.self_attn.k_scale"])


@pytest.mark.parametrize("case,needle", [
    ("q4_0", "has no calibrated scale"),
    ("no-calib", "add a calibration section"),
    ("gptq", "use format compressed-tensors"),
])
def test_bad_quantize_inputs_are_one_line(case, needle, tiny_llama, tmp_path):
    calib = ["--calib", CALIB_TEXT, "--samples", "2", "--seq-len", "16"]
    args = {
        "q4_0": ["--kv-cache", "q4_0", *calib],
        "no-calib": ["--kv-cache", "fp8"],
        "gptq": ["--kv-cache", "fp8", "--format", "gptq", *calib],
    }[case]
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "--group-size", "32", *args)
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value,needle", [("fp4", "is not a KV-cache format"), ("q8_0", "head_dim 16")])
def test_bad_eval_inputs_are_one_line(value, needle, tiny_llama):
    result = invoke("eval", "ppl", tiny_llama, "--text", EVAL_TEXT, "--max-tokens", "64", "--ctx", "32", "--kv-cache", value)
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
