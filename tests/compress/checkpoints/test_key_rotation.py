"""SpinQuant's R3 (``--rotate-online r3``): each head's queries and keys rotated after RoPE, recorded as
compressed-tensors' ``q_attn``/``k_cache`` transforms and seen by a quantized KV cache. References: compressed-tensors'
own ``TransformScheme``, its own transforms (``apply_transform_config``), and transformers' float forward of the
unrotated model."""

from __future__ import annotations

import json

import pytest
import torch

from compress.errors import CompressError
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import tiny_llama_config

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _model(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(**_SHAPE))
    with torch.no_grad():  # keys with outlier channels, as real models have: what R3 spreads before a 4-bit cache
        for block in model.model.layers:
            block.self_attn.k_proj.weight[::7] *= 8.0
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _rotate(model, out, **settings):
    return run_recipe(parse_recipe({"model": model, "stages": [{"method": "rotate", **settings}], "output": {"path": out}})).output


def test_the_config_is_compressed_tensors_r3_scheme():
    """Field for field the scheme llm-compressor's SpinQuantModifier builds for R3 (``_create_r3_scheme``)."""
    ct = pytest.importorskip("compressed_tensors.transform")
    from compress.checkpoints.transforms import r3_config

    theirs = ct.TransformScheme(type="random-hadamard", head_dim=16, apply=[
        ct.TransformArgs(targets=["re:.*self_attn$"], location="q_attn"),
        ct.TransformArgs(targets=["re:.*self_attn$"], location="k_cache")])
    config = ct.TransformConfig(config_groups={"R3": theirs}).model_dump()["config_groups"]
    assert r3_config("random-hadamard", 16) == json.loads(json.dumps(config))


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_a_quantized_cache_reads_what_compressed_tensors_transforms_compute(kind, tmp_path, tiny_tokenizer):
    """Our evaluator's int4 cache on an R3 checkpoint (keys quantized in the rotated basis and handed back, queries
    as computed) gives the logits of compressed-tensors' own R3: its query hook after RoPE and its ``k_cache``
    transform module on the keys the cache stores, quantized there. compressed-tensors' own cache hook sets
    ``past_key_value(s)``, which transformers 5's attention no longer reads (it takes ``cache``), so the test hands its
    key transform the keys at the cache's hand-over. Without a quantized cache the function is the unrotated model's."""
    ct = pytest.importorskip("compressed_tensors.transform")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from compress.checkpoints.attention import tap_kv_cache
    from compress.checkpoints.loading import load_model
    from compress.checkpoints.transforms import KEYS_ATTR
    from compress.eval.kv_cache import KVCacheSetting, simulate_kv_cache
    from compress.quantizers.kv_cache import KVCacheFormat, quantize_kv

    model = _model(tmp_path, tiny_tokenizer)
    out = _rotate(model, tmp_path / "r3", kind=kind, residual=False, heads=False, online=["r3"])
    config = json.loads((out / "config.json").read_text())
    stored = {k: v for k, v in load_file(out / "model.safetensors").items() if "R3" in k}
    assert sorted(stored) == ["model.layers.0.self_attn.R3_q_attn.weight"]  # once, as compressed-tensors writes it
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    fmt = KVCacheFormat.int4
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ct.apply_transform_config(theirs, ct.TransformConfig.model_validate(config["quantization_config"]["transform_config"]))
        matrix = next(iter(stored.values()))
        shared = {f"{n}.R3_{where}.weight": matrix for n, m in theirs.named_modules() if hasattr(m, "R3_q_attn")
                  for where in ("q_attn", "k_cache")}
        assert theirs.load_state_dict(shared, strict=False).unexpected_keys == []
        attention = {f"model.layers.{i}.self_attn": b.self_attn for i, b in enumerate(theirs.model.layers)}

        def their_cache(quantize):
            def transform(name, keys, values):
                keys = attention[name].R3_k_cache(keys)
                return (quantize_kv(keys, fmt), quantize_kv(values, fmt)) if quantize else (keys, values)
            with tap_kv_cache(attention, transform):
                return theirs(ids).logits

        float_theirs, expected = their_cache(False), their_cache(True)
        ours = load_model(out, torch.device("cpu"), torch.float32).eval()
        assert all(getattr(b.self_attn, KEYS_ATTR, None) is not None for b in ours.model.layers)
        plain = ours(ids).logits
        with simulate_kv_cache(ours, KVCacheSetting(fmt)):
            got = ours(ids).logits
        for block in ours.model.layers:  # the same cache on unrotated keys
            delattr(block.self_attn, KEYS_ATTR)
        with simulate_kv_cache(ours, KVCacheSetting(fmt)):
            unrotated = ours(ids).logits
        original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(ids).logits
    assert torch.allclose(plain, original, atol=1e-5) and torch.allclose(float_theirs, original, atol=1e-5)
    assert torch.allclose(got, expected, atol=1e-4 * expected.abs().max().item())
    assert not torch.allclose(got, unrotated, atol=1e-3)  # the rotation changed what the cache holds


def test_queries_without_keys_is_a_corrupt_config(tmp_path, tiny_tokenizer):
    from compress.checkpoints.loading import load_model

    out = _rotate(_model(tmp_path, tiny_tokenizer), tmp_path / "r3", residual=False, heads=False, online=["r3"])
    config = json.loads((out / "config.json").read_text())
    scheme = config["quantization_config"]["transform_config"]["config_groups"]["R3"]
    scheme["apply"] = scheme["apply"][:1]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CompressError, match="queries and keys of the same modules are rotated together") as caught:
        load_model(out, torch.device("cpu"), torch.float32)
    assert "\n" not in str(caught.value)


def test_r3_composes_with_either_input_rotation_and_with_the_fused_ones(tmp_path, tiny_tokenizer):
    model = _model(tmp_path, tiny_tokenizer)
    for online in (["r3", "r4"], ["inputs", "r3"]):
        out = _rotate(model, tmp_path / "-".join(online), online=online)
        groups = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]["config_groups"]
        assert "R3" in groups and len(groups) >= 2
    with pytest.raises(CompressError, match="give r4 or inputs, once"):
        _rotate(model, tmp_path / "all", online=["r3", "r4", "inputs"])


def test_a_moe_model_takes_r3(tmp_path, tiny_tokenizer):
    """R3 touches no expert: Mixtral's attention keeps its rotation for the cache, and the float function is kept."""
    from architectures import save_architecture
    from transformers import AutoModelForCausalLM

    from compress.checkpoints.loading import load_model
    from compress.checkpoints.transforms import KEYS_ATTR

    model = save_architecture("mixtral", tmp_path / "mixtral", tiny_tokenizer)
    out = _rotate(model, tmp_path / "r3", residual=False, heads=False, online=["r3"])
    ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = load_model(out, torch.device("cpu"), torch.float32).eval()
        assert all(getattr(b.self_attn, KEYS_ATTR, None) is not None for b in ours.model.layers)
        original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(ids).logits
        assert torch.allclose(ours(ids).logits, original, atol=1e-5)
