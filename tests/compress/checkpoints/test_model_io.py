"""Tests for compress.checkpoints.model_io: lazy skeletons, decoder blocks, quantizable layers, materialize/release."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from references import one_line_error
from compress.checkpoints.model_io import (
    ModelHandle,
    get_weight,
    is_conv1d,
    open_model,
    quantizable_layers,
    set_weight,
)
from conftest import save_random_model, tiny_llama_config




def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=300, bos_token_id=0, eos_token_id=0)


def opt_config():
    from transformers import OPTConfig

    return OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=300,
        word_embed_proj_dim=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


# name -> (config factory, blocks path, block count, quantizable layer suffixes per block)
ARCHS = {
    "llama": (
        tiny_llama_config,
        "model.layers",
        2,
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
    ),
    "gpt2": (gpt2_config, "transformer.h", 3, ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
    "opt": (
        opt_config,
        "model.decoder.layers",
        2,
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2"],
    ),
    "qwen2": (
        qwen2_config,
        "model.layers",
        2,
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("model-io")
    return {name: save_random_model(spec[0](), root / name) for name, spec in ARCHS.items()}


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> Path:
    return save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("llama-bf16"), dtype=torch.bfloat16)


# -- opening ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_open_model_finds_blocks(checkpoints, arch):
    _, blocks_name, count, _ = ARCHS[arch]
    handle = open_model(checkpoints[arch])
    assert isinstance(handle, ModelHandle)
    assert handle.blocks_name == blocks_name
    assert len(handle.blocks) == count
    assert handle.blocks is handle.model.get_submodule(blocks_name)
    assert handle.block_name(1) == f"{blocks_name}.1"
    params = list(handle.model.parameters())
    assert params and all(p.device.type == "meta" for p in params)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_quantizable_layers_default_is_block_linears(checkpoints, arch):
    _, blocks_name, count, suffixes = ARCHS[arch]
    handle = open_model(checkpoints[arch])
    layers = quantizable_layers(handle.model, [handle.blocks_name])
    expected = {f"{blocks_name}.{i}.{s}" for i in range(count) for s in suffixes}
    assert set(layers) == expected
    assert "lm_head" not in layers
    assert not any("embed" in n or "wte" in n or "wpe" in n for n in layers)
    for name, module in layers.items():
        assert module is handle.model.get_submodule(name)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_quantizable_layers_include_lm_head(checkpoints, arch):
    handle = open_model(checkpoints[arch])
    layers = quantizable_layers(handle.model, [handle.blocks_name], include=["lm_head"])
    assert list(layers) == ["lm_head"]
    assert layers["lm_head"] is handle.model.lm_head


def test_quantizable_layers_exclude(checkpoints):
    handle = open_model(checkpoints["llama"])
    all_layers = quantizable_layers(handle.model, [handle.blocks_name])
    layers = quantizable_layers(handle.model, [handle.blocks_name], exclude=[r"mlp\.down_proj", r"layers\.1\.self_attn"])
    removed = {n for n in all_layers if "mlp.down_proj" in n or "layers.1.self_attn" in n}
    assert len(removed) == 2 + 4
    assert set(layers) == set(all_layers) - removed


def test_quantizable_layers_include_and_exclude(checkpoints):
    handle = open_model(checkpoints["gpt2"])
    layers = quantizable_layers(handle.model, [handle.blocks_name], include=[r"c_attn", "lm_head"], exclude=[r"h\.0\."])
    assert set(layers) == {"transformer.h.1.attn.c_attn", "transformer.h.2.attn.c_attn", "lm_head"}


# -- weights as [out, in] -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_get_weight_is_out_by_in(checkpoints, arch):
    handle = open_model(checkpoints[arch])
    for name, module in quantizable_layers(handle.model, [handle.blocks_name], include=[".*"]).items():
        if isinstance(module, nn.Linear):
            expected = (module.out_features, module.in_features)
            assert not is_conv1d(module)
        else:
            expected = (module.nf, module.nx)
            assert is_conv1d(module)
        assert tuple(get_weight(module).shape) == expected, name


def test_gpt2_conv1d_weight_is_transposed(checkpoints):
    handle = open_model(checkpoints["gpt2"])
    c_attn = handle.model.get_submodule("transformer.h.0.attn.c_attn")
    assert is_conv1d(c_attn)
    assert tuple(c_attn.weight.shape) == (64, 192)  # stored [in, out]
    assert tuple(get_weight(c_attn).shape) == (192, 64)


def test_set_weight_round_trip_conv1d(checkpoints):
    handle = open_model(checkpoints["gpt2"])
    block = handle.blocks[0]
    handle.materialize(block, handle.block_name(0), "cpu", torch.float32)
    c_attn = block.attn.c_attn
    new = torch.randn(192, 64)
    set_weight(c_attn, new)
    assert torch.equal(get_weight(c_attn), new)
    assert torch.equal(c_attn.weight, new.t())
    # The orientation is the one the layer computes with: y = x W^T + b.
    x = torch.randn(3, 64)
    assert torch.allclose(c_attn(x), x @ new.t() + c_attn.bias, atol=1e-5)


def test_set_weight_round_trip_linear_keeps_dtype(checkpoints):
    handle = open_model(checkpoints["llama"])
    block = handle.blocks[0]
    handle.materialize(block, handle.block_name(0), "cpu", torch.bfloat16)
    k_proj = block.self_attn.k_proj
    new = torch.randn(32, 64)
    set_weight(k_proj, new)
    assert k_proj.weight.dtype == torch.bfloat16
    assert tuple(k_proj.weight.shape) == (32, 64)
    assert torch.equal(get_weight(k_proj), new.to(torch.bfloat16))


# -- materialize / release ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_materialize_block_loads_checkpoint_tensors(checkpoints, arch):
    path = checkpoints[arch]
    stored = load_file(str(path / "model.safetensors"))
    handle = open_model(path)
    block = handle.blocks[1]
    prefix = handle.block_name(1)
    dtypes = handle.materialize(block, prefix, "cpu", torch.float32)
    names = [n for n, _ in block.named_parameters()]
    assert sorted(dtypes) == sorted(names)
    for name, p in block.named_parameters():
        assert p.device.type == "cpu"
        assert not p.requires_grad
        assert dtypes[name] == torch.float32
        assert torch.equal(p, stored[f"{prefix}.{name}"]), name
    # Other blocks stay on meta.
    assert all(p.device.type == "meta" for p in handle.blocks[0].parameters())

    handle.release(block)
    for name, p in block.named_parameters():
        assert p.device.type == "meta", name
        assert p.shape == stored[f"{prefix}.{name}"].shape


def test_materialize_returns_stored_dtype(bf16_llama):
    stored = load_file(str(bf16_llama / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    handle = open_model(bf16_llama)
    block = handle.blocks[0]
    dtypes = handle.materialize(block, handle.block_name(0), "cpu", torch.float32)
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}
    for name, p in block.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, stored[f"model.layers.0.{name}"].float()), name
    handle.release(block)
    dtypes = handle.materialize(block, handle.block_name(0), "cpu", torch.bfloat16)
    for name, p in block.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, stored[f"model.layers.0.{name}"]), name


def test_materialize_only_and_release_only(checkpoints):
    path = checkpoints["llama"]
    stored = load_file(str(path / "model.safetensors"))
    handle = open_model(path)
    base = handle.base_model
    outer = set(handle.non_block_parameters(base))
    assert outer == {"embed_tokens.weight", "norm.weight"}
    dtypes = handle.materialize(base, handle.base_prefix, "cpu", torch.float32, only=outer)
    assert set(dtypes) == outer
    assert torch.equal(base.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert torch.equal(base.norm.weight, stored["model.norm.weight"])
    assert all(p.device.type == "meta" for p in handle.blocks.parameters())

    handle.release(base, only={"norm.weight"})
    assert base.norm.weight.device.type == "meta"
    assert base.embed_tokens.weight.device.type == "cpu"
    handle.release(base)
    assert all(p.device.type == "meta" for p in base.parameters())


def test_materialize_lm_head_untied(checkpoints):
    path = checkpoints["llama"]
    stored = load_file(str(path / "model.safetensors"))
    handle = open_model(path)
    handle.materialize(handle.model.lm_head, "lm_head", "cpu", torch.float32)
    assert torch.equal(handle.model.lm_head.weight, stored["lm_head.weight"])


# -- checkpoint keys ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_without_prefix(checkpoints, tmp_path_factory) -> Path:
    src = checkpoints["gpt2"]
    out = tmp_path_factory.mktemp("gpt2-noprefix")
    tensors = load_file(str(src / "model.safetensors"))
    assert all(k.startswith("transformer.") for k in tensors)
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def test_checkpoint_key_without_base_prefix(gpt2_without_prefix):
    stored = load_file(str(gpt2_without_prefix / "model.safetensors"))
    handle = open_model(gpt2_without_prefix)
    assert handle.base_prefix == "transformer"
    assert handle.checkpoint_key("transformer.h.0.attn.c_attn.weight") == "h.0.attn.c_attn.weight"
    assert handle.checkpoint_key("transformer.wte.weight") == "wte.weight"

    block = handle.blocks[2]
    handle.materialize(block, handle.block_name(2), "cpu", torch.float32)
    for name, p in block.named_parameters():
        assert torch.equal(p, stored[f"h.2.{name}"]), name

    base = handle.base_model
    outer = set(handle.non_block_parameters(base))
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"} <= outer
    handle.materialize(base, handle.base_prefix, "cpu", torch.float32, only=outer)
    for name in outer:
        assert torch.equal(base.get_parameter(name), stored[name]), name


def test_checkpoint_key_with_prefix_added(checkpoints):
    # Naming parameters relative to the base model still finds the prefixed checkpoint keys.
    handle = open_model(checkpoints["gpt2"])
    assert handle.checkpoint_key("wte.weight") == "transformer.wte.weight"
    assert handle.checkpoint_key("transformer.wte.weight") == "transformer.wte.weight"


def test_checkpoint_key_missing_is_an_error(checkpoints):
    handle = open_model(checkpoints["llama"])
    msg = one_line_error(handle.checkpoint_key, "model.layers.9.nothing.weight")
    assert "model.layers.9.nothing.weight" in msg


# -- tied parameters -----------------------------------------------------------------------------------------


def test_tied_parameter_names(checkpoints):
    assert open_model(checkpoints["gpt2"]).tied_parameter_names() == {"lm_head.weight"}
    assert open_model(checkpoints["llama"]).tied_parameter_names() == set()
    assert open_model(checkpoints["qwen2"]).tied_parameter_names() == set()


# -- errors --------------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    msg = one_line_error(open_model, tmp_path / "nope")
    assert str(tmp_path / "nope") in msg
    assert "does not exist" in msg


def test_file_instead_of_dir(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    msg = one_line_error(open_model, f)
    assert str(f) in msg
    assert "is a file" in msg


def test_dir_without_config(tmp_path):
    msg = one_line_error(open_model, tmp_path)
    assert "config.json" in msg


def test_invalid_json_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n  oops}\n')
    msg = one_line_error(open_model, tmp_path)
    assert "config.json" in msg
    assert "not valid JSON" in msg


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_architecture_xyz"}))
    msg = one_line_error(open_model, tmp_path)
    assert "config.json" in msg
    assert "no_such_architecture_xyz" in msg


def test_config_without_weights(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    msg = one_line_error(open_model, tmp_path)
    assert "no weights" in msg


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    msg = one_line_error(open_model, tmp_path)
    assert "not a causal language model" in msg


def test_config_json_null(tmp_path):
    (tmp_path / "config.json").write_text("null")
    one_line_error(open_model, tmp_path)
