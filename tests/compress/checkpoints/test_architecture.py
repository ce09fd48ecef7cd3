"""Scales moved between producers and consumers leave the model's function unchanged (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig, PhiConfig

from compress.checkpoints.architecture import BLOCK_MAPS, fold_scales, is_linear, resolve_groups
from compress.eval.outliers import inject_outliers
from compress.checkpoints.model_io import find_decoder_blocks
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
            for _group, prev, layers in resolve_groups(block, model.config.model_type):
                width = prev.weight.shape[0] if not is_linear(prev) else layers[0].weight.shape[-1]
                fold_scales(prev, layers, torch.exp(torch.randn(width)))  # spread over ~e^±2
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
