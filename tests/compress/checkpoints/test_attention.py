"""The KV-cache tap: found generically in three architectures, lossless when it changes nothing, on the
generation path too, and a one-line error for an attention that does not write through a cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, OPTConfig

from compress.checkpoints.attention import model_attention_modules, tap_kv_cache
from conftest import tiny_llama_config
from references import one_line_error


def build(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


CONFIGS = {
    "llama": (tiny_llama_config(300), "model.layers.{}.self_attn"),
    "gpt2": (GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300), "transformer.h.{}.attn"),
    "opt": (OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=300,
                      word_embed_proj_dim=64, max_position_embeddings=128), "model.decoder.layers.{}.self_attn"),
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_finds_each_blocks_attention_and_an_identity_tap_is_lossless(arch):
    config, pattern = CONFIGS[arch]
    model = build(config)
    modules = model_attention_modules(model)
    assert list(modules) == [pattern.format(i) for i in range(2)]
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    seen = []
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with tap_kv_cache(modules, lambda name, k, v: (seen.append((name, k.shape)), (k, v))[1]) as taps:
            tapped = model(ids, use_cache=False).logits
            taps.check_used("test")
    torch.testing.assert_close(tapped, plain, rtol=0, atol=1e-5)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    assert [n for n, _ in seen] == list(modules)
    assert all(shape[:3] == (2, heads, 24) for _, shape in seen)
    with torch.no_grad():  # hooks are gone once closed
        torch.testing.assert_close(model(ids, use_cache=False).logits, plain, rtol=0, atol=0)


def test_generation_path_stores_what_the_tap_returns():
    model = build(tiny_llama_config(300))
    modules = model_attention_modules(model)
    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), tap_kv_cache(modules, lambda name, k, v: (k.round(), v * 0)):
        model(ids, cache=cache, use_cache=True)
    assert torch.equal(cache.layers[0].keys, cache.layers[0].keys.round())  # the cache holds the transformed keys
    assert cache.layers[1].values.abs().sum() == 0


class _NoCacheAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class _SilentAttention(_NoCacheAttention):
    def forward(self, x, cache=None):  # takes a cache but never writes to it
        return self.proj(x)


class _Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attn = attention

    def forward(self, x, cache=None):
        return self.attn(x, cache=cache) if isinstance(self.attn, _SilentAttention) else self.attn(x)


class _Toy(nn.Module):
    def __init__(self, attention_type):
        super().__init__()
        self.config = type("Config", (), {"num_hidden_layers": 2})()
        self.layers = nn.ModuleList([_Block(attention_type()) for _ in range(2)])

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def test_an_attention_without_the_hook_is_one_line():
    assert "KV cache" in one_line_error(model_attention_modules, _Toy(_NoCacheAttention))
    model = _Toy(_SilentAttention)
    modules = model_attention_modules(model)
    assert list(modules) == ["layers.0.attn", "layers.1.attn"]
    with tap_kv_cache(modules, lambda name, k, v: (k, v)) as taps:
        model(torch.ones(1, 8))
        assert "layers.0.attn" in one_line_error(taps.check_used, "--kv-cache fp8")
