"""llama.cpp as the real consumer of our GGUF files (through llama-cpp-python).

Skipped where llama-cpp-python is not installed (it is in the ``gguf`` extra; it compiles llama.cpp at
install time), or, with the reason, where its build cannot run on this CPU (tests/eval/test_llama_cpp_worker.py
fails then). llama.cpp always runs in a child process (`compress.eval.llama_cpp_worker`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[gguf]'")

from compress.eval.llama_cpp_worker import quantize  # noqa: E402
from compress.eval.perplexity import evaluate  # noqa: E402
from compress.export.gguf import ExportConfig, export_gguf  # noqa: E402
from compress.formats.gguf.plan import PRESETS, Target  # noqa: E402
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL  # noqa: E402
from gguf_reference import llamacpp_model, llamacpp_perplexity, transformers_model  # noqa: E402

EVAL_TOKENS = 2048


@pytest.fixture(scope="module")
def eval_ids() -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json"))
    return tok.encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:EVAL_TOKENS]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, llama_cpp_runs):
    """One export per type of the reference model, made on first use."""
    root = tmp_path_factory.mktemp("gguf-llamacpp")
    cache = {}

    def get(target: Target):
        if target not in cache:
            cache[target] = root / f"ref-{target.value}.gguf"
            export_gguf(ExportConfig(REFERENCE_MODEL, cache[target], target))
        return cache[target]

    return get


# every plain type and one llama.cpp mix (the other mixes only combine these types differently), but the
# i-quants: IQ4_XS is checked on its GPTQ file (tests/compress/export/test_calibrated.py), IQ4_NL is IQ4_XS's
# codebook in blocks of 32 (its bytes are ggml's, test_ggml_reference.py), IQ3_S's file is llama.cpp's own (below),
# IQ3_XXS needs an imatrix (below)
@pytest.mark.parametrize(
    "target", [t for t in Target if t not in PRESETS | {Target.iq4_nl, Target.iq4_xs, Target.iq3_s, Target.iq3_xxs}] + [Target.q4_k_m],
    ids=lambda t: t.value,
)
def test_llama_cpp_loads_generates_and_agrees_with_our_evaluator(exported, eval_ids, target):
    """llama.cpp's perplexity of our file (its own logits, 512-token windows, no BOS) is within 0.5%
    of our evaluator's on transformers' dequantization of the same file."""
    path = exported(target)
    with llamacpp_model(path) as llm:
        out = llm.complete("ROMEO:", max_tokens=16)
    assert out["usage"]["completion_tokens"] > 0 and out["choices"][0]["text"].strip()
    ours = evaluate(transformers_model(path), torch.tensor(eval_ids), ctx=512).perplexity
    theirs = llamacpp_perplexity(path, eval_ids, ctx=512)
    assert abs(theirs / ours - 1) < 0.005, (theirs, ours)


def test_llama_cpp_tokenizes_like_the_hf_tokenizer(exported, eval_ids):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json"))
    text = EVAL_TEXT.read_text(encoding="utf-8")[:20000]
    with llamacpp_model(exported(Target.q8_0)) as llm:
        ours = llm.tokenize(text.encode(), add_bos=False, special=False)
    assert ours == tok.encode(text).ids


@pytest.fixture(scope="module")
def half_reference(tmp_path_factory, llama_cpp_runs):
    """The reference model stored in float16, so that our encoder and llama.cpp's (which quantizes
    from our F16 file) start from the same numbers."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("ref-f16") / "model"
    AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float16).save_pretrained(out)
    for f in REFERENCE_MODEL.glob("tokenizer*"):
        shutil.copy2(f, out / f.name)
    return out


def assert_llama_quantize_writes_ours(model, tmp_path, target: Target, ftype: int, pure: bool) -> dict[str, str]:
    """``llama_model_quantize`` (file type ``ftype``, in a child process) of our F16 file of ``model`` writes the
    same tensors, types and bytes as our ``target`` export of it; returns the tensor types."""
    from gguf import GGUFReader

    f16, ours, theirs = tmp_path / "f16.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    export_gguf(ExportConfig(model, f16, Target.f16))
    export_gguf(ExportConfig(model, ours, target))
    quantize(f16, theirs, ftype, pure=pure, threads=2)
    a = {t.name: (t.tensor_type.name, np.array(t.data).tobytes()) for t in GGUFReader(str(ours)).tensors}
    b = {t.name: (t.tensor_type.name, np.array(t.data).tobytes()) for t in GGUFReader(str(theirs)).tensors}
    types = {k: v[0] for k, v in a.items()}
    assert types == {k: v[0] for k, v in b.items()}
    differing = [k for k in a if a[k][1] != b[k][1]]
    assert not differing, differing
    return types


@pytest.mark.parametrize(
    "target, ftype", [(Target.q4_0, 2), (Target.q2_k, 10), (Target.q4_k, 14), (Target.q6_k, 18)],
    ids=lambda v: getattr(v, "value", str(v)),
)
def test_our_file_is_llama_quantize_output(half_reference, tmp_path, target, ftype):
    """``llama_model_quantize --pure`` of our F16 file writes the same tensor bytes as our exporter."""
    assert_llama_quantize_writes_ours(half_reference, tmp_path, target, ftype, pure=True)


def test_phi3_q4_k_m_is_llama_quantize_output(tmp_path, tiny_tokenizer, llama_cpp_runs):
    """llama-quantize's Q4_K_M rules on a fused ``attn_qkv`` (attn_v-like: Q6_K where use_more_bits) and the rest, on a Phi-3 wide
    enough for k-quant blocks: the same types and bytes as our exporter (from the same F16 file)."""
    from architectures import save_architecture

    model = save_architecture("phi3", tmp_path / "phi3", tiny_tokenizer, hidden_size=256, intermediate_size=512, dtype="float16")
    types = assert_llama_quantize_writes_ours(model, tmp_path, Target.q4_k_m, 15, pure=False)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert (types["blk.0.attn_qkv.weight"], types["blk.1.attn_qkv.weight"]) == ("Q4_K", "Q6_K")


@pytest.mark.parametrize("kind, experts, target, ftype", [("mixtral", 8, Target.q4_k_m, 15), ("mixtral", 8, Target.q3_k_m, 12),
                                                         ("qwen2_moe", 4, Target.q4_k_m, 15)], ids=["mixtral8-q4_k_m", "mixtral8-q3_k_m", "qwen2moe-q4_k_m"])
def test_moe_file_is_llama_quantize_output(tmp_path, tiny_tokenizer, llama_cpp_runs, kind, experts, target, ftype):
    """MoE experts stacked per block and role (``ffn_*_exps``), the router in F32, Qwen2-MoE's shared expert and
    its gate: ``llama_model_quantize`` of our F16 file writes the same types and bytes as our export, 8-expert
    rules included (attn_v/attn_k Q8_0, attn_output Q5_K: llama.cpp's Mixtral-8x7B bumps)."""
    from architectures import save_architecture

    sizes = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    counts = {"num_local_experts": experts} if kind == "mixtral" else {"num_experts": experts}
    model = save_architecture(kind, tmp_path / kind, tiny_tokenizer, dtype="float16", **sizes, **counts)
    types = assert_llama_quantize_writes_ours(model, tmp_path, target, ftype, pure=False)
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    if experts == 8:
        assert types["blk.1.attn_v.weight"] == types["blk.1.attn_k.weight"] == "Q8_0" and types["blk.1.attn_output.weight"] == "Q5_K"


@pytest.mark.parametrize("target, ftype, pure, blocks", [(Target.iq4_xs_mix, 30, False, 8), (Target.iq3_s, 26, True, 2),
                                                         (Target.iq3_m, 27, False, 8)],
                         ids=lambda v: getattr(v, "value", str(v)))
def test_i_quant_file_is_llama_quantize_output(tmp_path, tiny_tokenizer, llama_cpp_runs, target, ftype, pure, blocks):
    """``llama_model_quantize`` of our F16 file of a small float16 model (4 query heads per KV head) writes
    the same tensor types and bytes as our export: IQ3_S ``--pure``, and llama.cpp's IQ4_XS file type with
    its per-tensor rules (attn_v Q5_K for the GQA, blk.0.ffn_down Q5_K without an imatrix, output Q6_K, the
    rest IQ4_XS) as our ``iq4_xs_mix``."""
    from compress.formats.gguf import plan
    from compress.formats.gguf.sizes import GGMLType
    from conftest import save_random_model, tiny_llama_config

    config = tiny_llama_config(len(tiny_tokenizer), hidden_size=256, intermediate_size=256, num_hidden_layers=blocks,
                               num_attention_heads=4, num_key_value_heads=1)
    model = save_random_model(config, tmp_path / "model", tiny_tokenizer, seed=3, dtype=torch.float16)
    types = assert_llama_quantize_writes_ours(model, tmp_path, target, ftype, pure=pure)
    if target == Target.iq3_s:
        assert set(types[k] for k in types if not k.endswith("norm.weight")) == {target.value.upper()}
        return
    if target == Target.iq3_m:  # llama.cpp's IQ3_M: Q4_K for attn_v, attn_output and the first n/8 ffn_down
        assert types["blk.3.attn_v.weight"] == types["blk.3.attn_output.weight"] == types["blk.0.ffn_down.weight"] == "Q4_K"
        assert types["blk.1.ffn_down.weight"] == types["blk.1.attn_q.weight"] == "IQ3_S" and types["output.weight"] == "Q6_K"
        return
    assert types["blk.0.ffn_down.weight"] == types["blk.5.attn_v.weight"] == "Q5_K" and types["output.weight"] == "Q6_K"
    assert types["blk.1.ffn_down.weight"] == types["token_embd.weight"] == "IQ4_XS"
    # with an importance-weighted fit (an imatrix, or GPTQ) llama.cpp keeps ffn_down at the base type
    assert plan.tensor_type(Target.iq4_xs_mix, "blk.0.ffn_down.weight", (256, 256), 8, False, n_gqa=4, has_imatrix=True) == GGMLType.IQ4_XS


@pytest.fixture(scope="module")
def reference_imatrix(tmp_path_factory) -> Path:
    """``compress imatrix`` of the reference model on the calibration slice (32 windows of 512)."""
    from compress.export.imatrix import ImatrixConfig, run_imatrix

    imatrix = tmp_path_factory.mktemp("imatrix-test") / "imatrix.gguf"
    run_imatrix(ImatrixConfig(REFERENCE_MODEL, CALIB_TEXT, imatrix, samples=32, seq_len=512))
    return imatrix


NEEDS_IMATRIX_TYPES = {  # pure IQ3_XXS, and llama_tensor_get_type_impl's IQ2 branch on the reference model (n_gqa 2, 4 blocks: n/8 = 0, untied)
    Target.iq3_xxs: {"token_embd": "IQ3_XXS", "output": "IQ3_XXS", "blk.0.attn_v": "IQ3_XXS", "blk.0.ffn_down": "IQ3_XXS"},
    Target.iq2_xxs: {"token_embd": "Q2_K", "output": "Q5_K", "blk.0.attn_v": "Q2_K", "blk.3.attn_output": "IQ2_XXS",
                     "blk.0.ffn_down": "IQ2_XXS", "blk.0.attn_q": "IQ2_XXS"},
    Target.iq2_xs: {"token_embd": "Q2_K", "output": "Q5_K", "blk.0.attn_v": "Q2_K", "blk.3.attn_output": "IQ2_XS",
                    "blk.0.ffn_down": "IQ2_XS", "blk.0.attn_q": "IQ2_XS"},
    Target.iq2_m: {"token_embd": "IQ3_S", "output": "Q5_K", "blk.0.attn_v": "IQ3_S", "blk.3.attn_output": "IQ3_S",
                   "blk.0.ffn_down": "IQ2_S", "blk.0.attn_q": "IQ2_S"},
}


@pytest.mark.parametrize("target", list(NEEDS_IMATRIX_TYPES), ids=lambda t: t.value)
def test_types_that_need_an_imatrix_follow_llama_cpps_rules_and_llama_cpp_agrees(reference_imatrix, eval_ids, tmp_path, target):
    """IQ3_XXS and llama.cpp's IQ2_XXS, IQ2_XS and IQ2_M file types: refused without an importance matrix, as
    llama-quantize refuses them; with one, the types of ``llama_tensor_get_type_impl`` (its IQ2 branch), and
    llama.cpp's perplexity of the file within 0.5% of our evaluator's on transformers' dequantization."""
    from gguf import GGUFReader
    from references import one_line_error

    plain = tmp_path / "plain.gguf"
    assert "needs an importance matrix" in one_line_error(export_gguf, ExportConfig(REFERENCE_MODEL, plain, target))
    assert not plain.exists()
    path = tmp_path / f"{target.value}.gguf"
    export_gguf(ExportConfig(REFERENCE_MODEL, path, target, imatrix=reference_imatrix))
    types = {t.name.removesuffix(".weight"): t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert {k: types[k] for k in NEEDS_IMATRIX_TYPES[target]} == NEEDS_IMATRIX_TYPES[target]
    ours = evaluate(transformers_model(path), torch.tensor(eval_ids), ctx=512).perplexity
    theirs = llamacpp_perplexity(path, eval_ids, ctx=512)
    assert abs(theirs / ours - 1) < 0.005, (theirs, ours)


@pytest.mark.parametrize("target", [Target.q2_k, Target.q3_k], ids=lambda t: t.value)
def test_imatrix_export_lowers_llama_cpps_perplexity(exported, reference_imatrix, tmp_path_factory, target):
    """An imatrix from the calibration slice (``compress imatrix``, 32 windows of 512) steers the
    rounding toward the columns that carry signal: llama.cpp's perplexity on held-out text drops
    below plain rounding's (measured: Q2_K 65.59 -> 65.14, Q3_K 61.87 -> 61.10 on 4096 tokens)."""
    from tokenizers import Tokenizer

    weighted = tmp_path_factory.mktemp("imatrix-export") / f"ref-{target.value}-imatrix.gguf"
    export_gguf(ExportConfig(REFERENCE_MODEL, weighted, target, imatrix=reference_imatrix))
    ids = Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json")).encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:4096]
    plain_ppl = llamacpp_perplexity(exported(target), ids)
    weighted_ppl = llamacpp_perplexity(weighted, ids)
    assert weighted_ppl < plain_ppl, (weighted_ppl, plain_ppl)


# -- a real model whose width (576) is not a multiple of 256: per-tensor fallbacks as llama.cpp's ---------
def test_smollm2_q4_k_m_falls_back_like_llama_quantize(smollm2, tmp_path, llama_cpp_runs):
    """Our Q4_K_M of SmolLM2 has llama-quantize's per-tensor types and file size on the same F16 file, reports
    its fallbacks, and llama.cpp's perplexity of it is within 0.5% of our evaluator's. (The whole model: a
    truncated one has a perplexity in the millions, where both evaluators' rounding differences blow up.)"""
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    from compress.formats.gguf.plan import FILE_TYPE

    f16, ours, theirs = tmp_path / "f16.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    export_gguf(ExportConfig(smollm2, f16, Target.f16))
    result = export_gguf(ExportConfig(smollm2, ours, Target.q4_k_m))
    quantize(f16, theirs, FILE_TYPE[Target.q4_k_m], pure=False, threads=2)
    our_types = {t.name: t.tensor_type.name for t in GGUFReader(str(ours)).tensors}
    assert our_types == {t.name: t.tensor_type.name for t in GGUFReader(str(theirs)).tensors}
    assert abs(ours.stat().st_size - theirs.stat().st_size) < 64 << 10  # metadata differs, tensor bytes do not
    fell = {f["tensor"]: (f["planned"], f["written"]) for f in result.fallbacks}
    assert fell["blk.0.attn_q.weight"] == ("Q4_K", "Q5_0") and all(our_types[k] == w for k, (_, w) in fell.items())
    assert any("fell back" in note for note in result.notes)
    ids = Tokenizer.from_file(str(smollm2 / "tokenizer.json")).encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:1024]
    mine = evaluate(transformers_model(ours), torch.tensor(ids), ctx=512).perplexity
    assert abs(llamacpp_perplexity(ours, ids, ctx=512) / mine - 1) < 0.005


@pytest.mark.parametrize(
    "kind,overrides",
    [("qwen3", {"head_dim": 32}), ("phi3", {}), ("gemma2", {"tie_word_embeddings": True, "query_pre_attn_scalar": 16}),
     ("gemma3_text", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
                          pad_token_id=0)),
     ("gpt2", {}), ("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {"norm_topk_prob": True})],
    ids=["qwen3", "phi3", "gemma2", "gemma3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe"],
)
def test_llama_cpp_runs_our_file_of_another_architecture(tmp_path, tiny_tokenizer, llama_cpp_runs, kind, overrides):
    """Qwen3 (per-head q/k RMS norms, head_dim 32 where hidden/heads is 16), Phi-3 (fused q/k/v and gate/up) and
    Gemma 2 (norms as 1 + w, four norms a block, logit soft-capping, scaled embeddings) and Gemma 3 (q/k norms,
    5 sliding-window layers of 6 with their own RoPE base: 7 blocks use both), all NEOX RoPE; GPT-2 (Conv1D weights,
    learned positions, LayerNorm) and the MoE families (stacked experts; Qwen2-MoE's gated shared expert): llama.cpp's
    perplexity of our F16 file is within 0.5% of transformers' on the checkpoint, and its raw logits agree."""
    from transformers import AutoModelForCausalLM

    from architectures import save_architecture

    if kind == "gemma3_text":  # not among the engine's test architectures: built here
        from transformers import AutoConfig

        from conftest import save_random_model

        config = AutoConfig.for_model(kind, vocab_size=len(tiny_tokenizer), **overrides)
        model = save_random_model(config, tmp_path / kind, tiny_tokenizer)
    else:
        model = save_architecture(kind, tmp_path / kind, tiny_tokenizer, **overrides)
    out = tmp_path / f"{kind}-f16.gguf"
    export_gguf(ExportConfig(model, out, Target.f16))
    ids = tiny_tokenizer(EVAL_TEXT.read_text(encoding="utf-8"))["input_ids"][:1024]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ours = evaluate(hf, torch.tensor(ids), ctx=256).perplexity
    theirs = llamacpp_perplexity(out, ids, ctx=256)
    assert abs(theirs / ours - 1) < 0.005, (theirs, ours)
    # a random model's distributions are nearly uniform, so perplexity alone misses a wrong scale: the raw logits too
    with torch.no_grad():
        expected = hf(torch.tensor([ids[:128]])).logits[0].double().numpy()
    with llamacpp_model(out, 256) as llm:
        got = np.asarray(llm.scores(ids[:128]), dtype=np.float64)
    assert np.sqrt(np.mean((got - expected) ** 2)) < 0.005 * np.sqrt(np.mean(expected**2))  # F16 weights: ~0.1 %
