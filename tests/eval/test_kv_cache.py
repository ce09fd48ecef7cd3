"""The simulated KV cache: keys quantized after RoPE and values after their projection, per KV head, as an
independent patch of transformers' own Llama functions does it; the cost in KLD; one-line errors."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from compress.checkpoints.loading import load_model
from compress.eval.checkpoint import evaluate_checkpoint
from compress.eval.kv_cache import KVCacheSetting, parse_kv_cache, simulate_kv_cache
from compress.quantizers.kv_cache import KVCacheFormat, quantize_kv
from conftest import EVAL_TEXT, REFERENCE_MODEL
from references import one_line_error


@pytest.fixture(scope="module")
def reference():
    return load_model(REFERENCE_MODEL, torch.device("cpu"))


@pytest.mark.parametrize("fmt", [KVCacheFormat.int4, KVCacheFormat.q4_0, KVCacheFormat.fp8])
def test_simulation_equals_patching_rope_output_and_v_proj(reference, fmt, monkeypatch):
    ids = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), simulate_kv_cache(reference, KVCacheSetting(fmt)):
        simulated = reference(ids, use_cache=False).logits

    rope = modeling_llama.apply_rotary_pos_emb

    def rope_then_quantize(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, quantize_kv(k, fmt)

    def quantize_values(module, _args, out):  # [b, s, kv_heads·d] -> cache layout and back
        b, s, _ = out.shape
        v = out.view(b, s, -1, 64).transpose(1, 2)
        return quantize_kv(v, fmt).transpose(1, 2).reshape(b, s, -1)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope_then_quantize)
    hooks = [layer.self_attn.v_proj.register_forward_hook(quantize_values) for layer in reference.model.layers]
    try:
        with torch.no_grad():
            patched = reference(ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(simulated, patched, rtol=0, atol=1e-5)
    with torch.no_grad():
        assert (reference(ids, use_cache=False).logits - simulated).abs().max() > 1e-3  # the formats do cost something


def test_kld_of_each_format(reference):
    from compress.checkpoints.loading import load_tokenizer
    from compress.eval.perplexity import evaluate

    tokens = torch.tensor(load_tokenizer(REFERENCE_MODEL)(EVAL_TEXT.read_text()[:6000], add_special_tokens=False)["input_ids"][:512])
    model = load_model(REFERENCE_MODEL, torch.device("cpu"))  # a second copy: the reference runs unquantized

    def run(fmt):
        with simulate_kv_cache(model, KVCacheSetting(fmt)):
            return evaluate(model, tokens, ctx=256, reference=reference)

    plain = evaluate(model, tokens, ctx=256, reference=reference)
    fp8, q8_0, int4 = run(KVCacheFormat.fp8), run(KVCacheFormat.q8_0), run(KVCacheFormat.int4)
    assert plain.kld == pytest.approx(0, abs=1e-7)
    assert 0 < q8_0.kld < fp8.kld < int4.kld  # 8-bit blocks < 3 mantissa bits < 4-bit integers
    assert fp8.ref_perplexity == pytest.approx(plain.perplexity)  # the reference is left alone


def test_bad_inputs_are_one_line_errors(tiny_llama):
    assert "fp4" in one_line_error(parse_kv_cache, "fp4")
    assert parse_kv_cache("q8_0") == KVCacheFormat.q8_0 and parse_kv_cache("none") == "none"
    # the tiny Llama's head_dim is 16: llama.cpp's blocks of 32 do not fit
    msg = one_line_error(evaluate_checkpoint, tiny_llama, EVAL_TEXT, ctx=32, max_tokens=64, kv_cache=KVCacheFormat.q8_0)
    assert "head_dim 16" in msg


def test_report_simulates_the_outputs_not_the_baseline(tiny_llama):
    from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs

    protocol = Protocol(EVAL_TEXT, ctx=32, max_tokens=96, kv_cache="int4")
    report = evaluate_outputs([tiny_llama], tiny_llama, protocol)
    assert report.baseline.kld == 0 and report.rows[0].kld > 0  # the same weights: only the cache differs
    assert report.rows[0].extra["kv_cache"] == "int4, dynamic scale per token and head"
    assert report.protocol["kv_cache"] == "int4"
    plain = evaluate_outputs([tiny_llama], tiny_llama, Protocol(EVAL_TEXT, ctx=32, max_tokens=96))
    assert plain.rows[0].kld == pytest.approx(0, abs=1e-7) and "kv_cache" not in plain.rows[0].extra
    msg = one_line_error(evaluate_outputs, [tiny_llama], tiny_llama, protocol, GGUFBackend.LLAMA_CPP)
    assert "--gguf-backend dequantize" in msg
