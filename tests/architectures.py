"""Tiny random checkpoints of every architecture family we support, from transformers configs.

Width 64, 2 blocks, 4 experts (top 2) for MoE, the vocabulary of the ``tiny_tokenizer`` fixture; norms
are perturbed away from 1 (and biases from 0) so a fold that forgets one of them shows.
"""

from __future__ import annotations

from pathlib import Path

import torch

_TOKENS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

ARCHITECTURES: dict[str, dict] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": {**_LLAMA_LIKE, "head_dim": 16},
    "gemma2": {**_LLAMA_LIKE, "head_dim": 16},
    "phi3": _LLAMA_LIKE,
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                word_embed_proj_dim=64),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256, tie_word_embeddings=False),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),  # parallel attention, one norm
    "mixtral": {**_LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_LLAMA_LIKE, **_MOE, "shared_expert_intermediate_size": 64},
    "qwen3_moe": {**_LLAMA_LIKE, **_MOE, "head_dim": 16},
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def architecture_config(model_type: str, vocab_size: int, **overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **_TOKENS, **{**ARCHITECTURES[model_type], **overrides})


def random_model(model_type: str, vocab_size: int, seed: int = 0, **overrides):
    """A randomly initialised eval-mode model with non-trivial norms and biases."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(architecture_config(model_type, vocab_size, **overrides)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and "norm" in name.lower() and name.endswith("weight"):
                parameter.mul_(1 + 0.5 * torch.rand_like(parameter)).add_(0.1 * torch.rand_like(parameter))
            elif parameter.dim() == 1 and name.endswith("bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def save_architecture(model_type: str, out: Path, tokenizer, **overrides) -> Path:
    """``random_model`` saved by transformers (its own on-disk layout) with the tokenizer."""
    model = random_model(model_type, len(tokenizer), **overrides)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
