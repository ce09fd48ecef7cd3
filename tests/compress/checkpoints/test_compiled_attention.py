"""The attention function opened models run: the compiled loop takes a bfloat16 model's plain causal calls, and
every call SDPA would run otherwise (a padding mask, float32, gradients) goes to transformers' SDPA unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from compress.checkpoints import compiled_attention
from compress.kernels import cpu_attention
from conftest import tiny_llama_config

needs_bf16_cpu = pytest.mark.skipif(not cpu_attention.available(),
                                    reason="this CPU has no AVX512-BF16 (or no C compiler): models keep SDPA")


def _models(dtype: torch.dtype):
    """A tiny Llama (head dim 32, two query heads per kv head) as transformers builds it (SDPA), and a copy given
    `sdpa_or_compiled` whether or not this machine runs the loop."""
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(tiny_llama_config(300, hidden_size=128)).to(dtype).eval()
    ours = copy.deepcopy(sdpa)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(compiled_attention.NAME, compiled_attention.sdpa_or_compiled)
    AttentionMaskInterface.register(compiled_attention.NAME, sdpa_mask)
    ours.set_attn_implementation(compiled_attention.NAME)
    return sdpa, ours


def _counting(monkeypatch) -> list:
    calls = []
    real = cpu_attention.causal_attention_bf16
    monkeypatch.setattr(cpu_attention, "causal_attention_bf16", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    return calls


IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))


@needs_bf16_cpu
def test_a_bfloat16_models_causal_calls_take_the_loop_and_its_logits_are_sdpas(monkeypatch):
    sdpa, ours = _models(torch.bfloat16)
    exact = copy.deepcopy(sdpa).float()  # the same weights in float32: what bfloat16 arithmetic approximates
    calls = _counting(monkeypatch)
    with torch.no_grad():
        expected, got, truth = sdpa(IDS).logits.float(), ours(IDS).logits.float(), exact(IDS).logits
    assert calls == [(2, 4, 40, 32)] * 2  # both blocks
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
    # as close to the float32 model as SDPA's bfloat16 run is
    assert (got - truth).abs().mean() <= 1.25 * (expected - truth).abs().mean()


@pytest.mark.parametrize("case", ["padding mask", "float32", "gradients"])
def test_calls_sdpa_would_not_run_plainly_are_sdpas_bit_for_bit(case, monkeypatch):
    sdpa, ours = _models(torch.float32 if case == "float32" else torch.bfloat16)
    calls = _counting(monkeypatch)
    mask = torch.ones_like(IDS)
    if case == "padding mask":
        mask[0, :5] = 0  # left padding: transformers builds a mask, so SDPA gets one
    with torch.set_grad_enabled(case == "gradients"):
        expected, got = sdpa(IDS, attention_mask=mask).logits, ours(IDS, attention_mask=mask).logits
    assert calls == []
    assert torch.equal(got, expected)
    if case == "gradients":
        got.float().square().mean().backward()  # the graph is SDPA's: it has a backward
        assert ours.model.layers[0].self_attn.q_proj.weight.grad is not None


@needs_bf16_cpu
def test_only_models_given_sdpa_are_switched():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(300, hidden_size=128)).eval()
    assert compiled_attention.prefer_compiled_attention(model)
    assert model.config._attn_implementation == compiled_attention.NAME
    eager = AutoModelForCausalLM.from_config(tiny_llama_config(300, hidden_size=128), attn_implementation="eager")
    assert not compiled_attention.prefer_compiled_attention(eager)
    assert eager.config._attn_implementation == "eager"
