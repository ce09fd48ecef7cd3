"""Scales moved between producers and consumers leave the model's function unchanged (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig, PhiConfig

from compress.checkpoints.architecture import BLOCK_MAPS, resolve_groups
from compress.eval.outliers import inject_outliers
from compress.checkpoints.model_io import find_decoder_blocks, open_model
from architectures import save_architecture
from conftest import tiny_llama_config
from references import one_line_error

CONFIGS = {
    "llama-gqa": lambda: tiny_llama_config(),
    "llama-mha": lambda: tiny_llama_config(num_key_value_heads=4),
    "opt": lambda: OPTConfig(vocab_size=300, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                             word_embed_proj_dim=64, max_position_embeddings=128),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300),
}


def _model(name: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a fold that forgets one of them shows
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm,)) or type(module).__name__.endswith("RMSNorm"):
                module.weight.mul_(1 + 0.5 * torch.rand_like(module.weight))
                if getattr(module, "bias", None) is not None:
                    module.bias.add_(0.1 * torch.randn_like(module.bias))
    return model


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.mark.parametrize("name", CONFIGS)
def test_folding_random_scales_keeps_logits(name):
    model = _model(name)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        before = model(ids).logits
        _, blocks = find_decoder_blocks(model, model.config.num_hidden_layers)
        folded = 0
        for block in blocks:
            for group in resolve_groups(block, model.config.model_type):
                group.fold(torch.exp(torch.randn(group.width)))  # spread over ~e^±2
                folded += 1
        after = model(ids).logits
    expected_groups = {"llama-gqa": 3, "llama-mha": 4, "opt": 4, "gpt2": 2}[name]  # GQA: v->o not foldable
    assert folded == expected_groups * model.config.num_hidden_layers
    assert _relative_difference(before, after) < 1e-4


def test_injected_outliers_keep_logits_and_create_outliers():
    model = _model("llama-gqa")
    ids = torch.randint(0, 300, (2, 24))
    captured = {}
    block = model.model.layers[0]
    block.self_attn.q_proj.register_forward_pre_hook(lambda m, a: captured.__setitem__("x", a[0].abs().amax(dim=(0, 1))))
    with torch.no_grad():
        before = model(ids).logits
        quiet = captured["x"].clone()
        inject_outliers(model, [3, 17], factor=50.0)
        after = model(ids).logits
    assert _relative_difference(before, after) < 1e-4
    ratio = captured["x"] / quiet
    assert torch.allclose(ratio[[3, 17]], torch.tensor(50.0), rtol=1e-4)
    assert torch.allclose(ratio[[0, 1, 2]], torch.tensor(1.0), rtol=1e-4)


def test_architecture_without_mapping_is_a_clear_error(tmp_path):
    model = AutoModelForCausalLM.from_config(PhiConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=1, num_attention_heads=4))
    assert model.config.model_type not in BLOCK_MAPS
    message = one_line_error(resolve_groups, model.model.layers[0], model.config.model_type)
    assert "no norm-to-linear mapping" in message and "'phi'" in message and "BLOCK_MAPS" in message


# -- every architecture family, read back through our lazy reader (transformers' renamings, unfused experts) --
FOLDED_PER_BLOCK = {  # scale groups the maps resolve in one block (GQA: v -> o is not foldable)
    "llama": 3, "mistral": 3, "qwen2": 3, "qwen3": 3, "gemma2": 3, "phi3": 3, "gpt2": 2, "opt": 4, "gpt_neox": 2,
    "bloom": 2, "falcon": 1, "falcon-two-norms": 2, "falcon-sequential": 2,
    # norm -> q/k/v, norm -> every expert's gate/up (+ shared expert; router folded too), each expert's up -> down
    "mixtral": 1 + 1 + 4, "qwen2_moe": 1 + 1 + 1 + 4, "qwen3_moe": 1 + 1 + 4,
}
VARIANTS = {"falcon-two-norms": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
            "falcon-sequential": ("falcon", {"parallel_attn": False})}


def _our_model(path):
    """The checkpoint through `open_model` (renamed names, experts unfused), every weight materialized."""
    handle = open_model(path)
    tied = handle.tied_parameter_names()
    handle.materialize(handle.model, "", "cpu", torch.float32, only={n for n, _ in handle.model.named_parameters()} - tied)
    if tied:
        handle.model.tie_weights()
    return handle


@pytest.mark.parametrize("name", FOLDED_PER_BLOCK)
def test_every_architecture_loads_and_folds_exactly(name, tmp_path, tiny_tokenizer):
    """Our reader gives transformers' own logits (GPT-NeoX's embed_out, Mixtral's block_sparse_moe, per-expert
    tensors into per-expert layers), and folding random scales into every mapped group keeps them."""
    model_type, overrides = VARIANTS.get(name, (name, {}))
    path = save_architecture(model_type, tmp_path / name, tiny_tokenizer, **overrides)
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
        handle = _our_model(path)
        before = handle.model(ids).logits
        assert _relative_difference(expected, before) < 1e-5
        folded = 0
        for block in handle.blocks:
            for group in resolve_groups(block, model_type):
                group.fold(torch.exp(torch.randn(group.width)))
                folded += 1
        after = handle.model(ids).logits
    assert folded == FOLDED_PER_BLOCK[name] * len(handle.blocks)
    assert _relative_difference(before, after) < 1e-4
