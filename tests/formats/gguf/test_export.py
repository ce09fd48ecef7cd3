"""GGUF export: metadata and tokenizer as gguf-py reads them, and transformers as the consumer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from compress.errors import CompressError  # noqa: E402
from compress.export.gguf import ExportConfig, export_gguf, permute_rope  # noqa: E402
from compress.formats.gguf.plan import Target  # noqa: E402
from conftest import CALIB_TEXT, REFERENCE_MODEL, save_random_model, tiny_llama_config  # noqa: E402
from gguf_reference import read_fields, tensor_types, transformers_model  # noqa: E402
from references import one_line_error  # noqa: E402


def export(model, tmp_path, target: Target, name: str | None = None):
    out = tmp_path / (name or f"model-{target.value}.gguf")
    return export_gguf(ExportConfig(model, out, target)), out


def hf_with_decoded_weights(model_dir, target: Target):
    """The HF model with every matrix replaced by our codec's decode(encode()) of it: the weights a
    correct GGUF file must carry (Q/K are permuted before encoding and un-permuted after, by the
    textbook inverse, the reshape transformers' loader uses)."""
    from transformers import AutoModelForCausalLM

    from compress.formats.gguf import plan
    from compress.formats.gguf.codecs import decode_tensor, encode_tensor

    from transformers.pytorch_utils import Conv1D

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    arch = "gpt2" if cfg.model_type == "gpt2" else "llama"
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue
            conv1d = isinstance(modules[name.rsplit(".", 1)[0]], Conv1D)  # weight [in, out]: GGUF rows are outputs
            w = p.detach().t() if conv1d else p.detach()
            kind = plan.tensor_type(target, plan.gguf_name(name, arch), tuple(w.shape), cfg.num_hidden_layers, cfg.tie_word_embeddings)
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": getattr(cfg, "num_key_value_heads", None)}.get(name.split(".")[-2])
            permuted = heads and cfg.model_type not in ("qwen2", "qwen3", "phi3")  # GGML's NEOX-RoPE archs: as HF does
            w = permute_rope(w, heads) if permuted else w
            d = torch.from_numpy(decode_tensor(encode_tensor(w.contiguous().numpy(), kind), kind, w.shape[1]).copy())
            if permuted:
                d = d.reshape(heads, d.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(d.shape)
            p.copy_(d.t() if conv1d else d)
    return model


def test_metadata_and_tokenizer_of_the_reference_model(tmp_path):
    result, out = export(REFERENCE_MODEL, tmp_path, Target.q8_0)
    f = read_fields(out)
    cfg = json.loads((REFERENCE_MODEL / "config.json").read_text())
    spec = json.loads((REFERENCE_MODEL / "tokenizer.json").read_text())
    assert f["general.architecture"] == "llama"
    assert f["general.quantization_version"] == 2
    assert f["general.file_type"] == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    assert f["llama.block_count"] == cfg["num_hidden_layers"]
    assert f["llama.embedding_length"] == cfg["hidden_size"]
    assert f["llama.feed_forward_length"] == cfg["intermediate_size"]
    assert f["llama.attention.head_count"] == cfg["num_attention_heads"]
    assert f["llama.attention.head_count_kv"] == cfg["num_key_value_heads"]
    assert f["llama.context_length"] == cfg["max_position_embeddings"]
    assert f["llama.rope.dimension_count"] == cfg["head_dim"]
    assert f["llama.rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    assert f["tokenizer.ggml.model"] == "gpt2"
    assert f["tokenizer.ggml.pre"] == "gpt-2"  # HF ByteLevel(use_regex=True) is GPT-2's split regex
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg["vocab_size"]
    assert all(tokens[i] == t for t, i in spec["model"]["vocab"].items())
    assert len(f["tokenizer.ggml.merges"]) == len(spec["model"]["merges"])
    assert f["tokenizer.ggml.merges"][0] == " ".join(spec["model"]["merges"][0])
    assert f["tokenizer.ggml.bos_token_id"] == cfg["bos_token_id"]
    assert f["tokenizer.ggml.eos_token_id"] == cfg["eos_token_id"]
    assert f["tokenizer.ggml.token_type"][0] == 3  # <|endoftext|> is a control token
    types = tensor_types(out)
    assert types["output_norm.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.3.ffn_down.weight"] == "Q8_0" and types["output.weight"] == "Q8_0"
    assert out.stat().st_size == result.file_bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


@pytest.mark.parametrize("target", [Target.f16, Target.bf16, Target.q8_0, Target.q4_0, Target.q5_1, Target.q2_k, Target.q3_k, Target.q4_k_m, Target.q5_k, Target.q6_k])
def test_transformers_loads_the_file_with_the_encoded_weights(kquant_llama, tmp_path, target):
    """transformers (gguf-py dequantization, its own Q/K un-permutation, config from metadata) gives
    the same logits as the HF model holding our decoded weights."""
    _, out = export(kquant_llama, tmp_path, target)
    loaded = transformers_model(out)
    expected = hf_with_decoded_weights(kquant_llama, target)
    ids = torch.randint(0, expected.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(ids).logits, expected(ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_tokenizer_round_trips_through_transformers(tmp_path):
    from transformers import AutoTokenizer

    _, out = export(REFERENCE_MODEL, tmp_path, Target.q8_0)
    ours = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    hf = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?  It is the east.\n"
    assert ours(text, add_special_tokens=False)["input_ids"] == hf(text, add_special_tokens=False)["input_ids"]


def test_tied_embeddings_write_no_output_tensor(tmp_path, tiny_tokenizer):
    model = save_random_model(
        tiny_llama_config(len(tiny_tokenizer), hidden_size=256, intermediate_size=512, tie_word_embeddings=True),
        tmp_path / "tied", tiny_tokenizer,
    )
    _, out = export(model, tmp_path, Target.q4_k_m)
    types = tensor_types(out)
    assert "output.weight" not in types
    assert types["token_embd.weight"] == "Q6_K"  # tied: the embeddings take the output tensor's type
    loaded = transformers_model(out)
    assert loaded.config.tie_word_embeddings
    expected = hf_with_decoded_weights(model, Target.q4_k_m)
    ids = torch.arange(40).reshape(1, -1)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected(ids).logits, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "qwen3"])
def test_qwen2_qwen3_and_mistral_export(tmp_path, tiny_tokenizer, kind):
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config}[kind]
    # transformers' GGUF loader ignores qwen3's key_length and takes Qwen3Config's default head_dim, 128 (real Qwen3's)
    extra = {"head_dim": 128} if kind == "qwen3" else {}
    config = cls(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, **extra,
    )
    model = save_random_model(config, tmp_path / kind, tiny_tokenizer)
    if kind != "mistral":  # Qwen2's q/k/v biases and Qwen3's q/k norms: away from 0 and 1, so a wrong mapping shows
        from safetensors.torch import load_file, save_file

        state = load_file(model / "model.safetensors")
        for k in state:
            if k.endswith("bias") or "_norm." in k:
                state[k] = state[k] + torch.randn_like(state[k]) * 0.1
        save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    _, out = export(model, tmp_path, Target.q8_0)
    fields = read_fields(out)
    assert fields["general.architecture"] == ("llama" if kind == "mistral" else kind)
    if kind == "qwen3":
        assert fields["qwen3.attention.key_length"] == fields["qwen3.attention.value_length"] == 128
    _assert_transformers_reads_the_decoded_weights(model, out)


def test_phi3_export_keeps_qkv_and_gate_up_fused(tmp_path, tiny_tokenizer):
    """Phi-3 stores q/k/v and gate/up fused; llama.cpp's phi3 reads them as ``attn_qkv`` and ``ffn_up`` (2 x ff rows)."""
    from architectures import save_architecture
    from gguf import GGUFReader

    model = save_architecture("phi3", tmp_path / "phi3", tiny_tokenizer)
    _, out = export(model, tmp_path, Target.q8_0)
    shapes = {t.name: [int(d) for d in t.shape] for t in GGUFReader(str(out)).tensors}
    assert shapes["blk.0.attn_qkv.weight"] == [64, 64 + 2 * 32] and shapes["blk.0.ffn_up.weight"] == [64, 2 * 128]
    assert read_fields(out)["general.architecture"] == "phi3"
    _assert_transformers_reads_the_decoded_weights(model, out)


def test_gemma2_export(tmp_path, tiny_tokenizer):
    """Gemma 2: norms stored as 1 + w (transformers' loader subtracts the 1 again), four norms a block mapped to
    llama.cpp's names, soft-capping and key length recorded; an untied lm_head or a query scale llama.cpp cannot
    apply are one-line errors."""
    from architectures import save_architecture

    # transformers' GGUF loader takes query_pre_attn_scalar from Gemma2Config's default, 256 (real Gemma 2's head_dim)
    model = save_architecture("gemma2", tmp_path / "gemma2", tiny_tokenizer, tie_word_embeddings=True, head_dim=256,
                              query_pre_attn_scalar=256)
    _, out = export(model, tmp_path, Target.q8_0)
    fields = read_fields(out)
    assert fields["general.architecture"] == "gemma2" and fields["gemma2.attention.key_length"] == 256
    assert fields["gemma2.final_logit_softcapping"] == pytest.approx(30.0)
    from gguf import GGUFReader
    from safetensors.torch import load_file

    norms = {t.name: np.array(t.data) for t in GGUFReader(str(out)).tensors if t.name.startswith("blk.0.") and "norm" in t.name}
    assert set(norms) == {f"blk.0.{n}.weight" for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")}
    hf = load_file(model / "model.safetensors")
    assert np.array_equal(norms["blk.0.post_ffw_norm.weight"], hf["model.layers.0.post_feedforward_layernorm.weight"].numpy() + 1)
    _assert_transformers_reads_the_decoded_weights(model, out)
    untied = save_architecture("gemma2", tmp_path / "untied", tiny_tokenizer, query_pre_attn_scalar=16)
    assert "untied lm_head" in one_line_error(export_gguf, ExportConfig(untied, tmp_path / "u.gguf", Target.q8_0))
    scaled = save_architecture("gemma2", tmp_path / "scaled", tiny_tokenizer, tie_word_embeddings=True, query_pre_attn_scalar=64)
    assert "query_pre_attn_scalar 64" in one_line_error(export_gguf, ExportConfig(scaled, tmp_path / "s.gguf", Target.q8_0))
    assert not (tmp_path / "u.gguf").exists() and not (tmp_path / "s.gguf").exists()


def _assert_transformers_reads_the_decoded_weights(model, out) -> None:
    """transformers' GGUF loader on our Q8_0 file gives the logits of the checkpoint with our codec's round trip."""
    loaded = transformers_model(out)
    expected = hf_with_decoded_weights(model, Target.q8_0)
    ids = torch.arange(1, 33).reshape(1, -1)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected(ids).logits, atol=1e-5)


def test_gpt2_export(tmp_path, tiny_tokenizer):
    """GPT-2 as llama.cpp's converter writes it: its own tensor names, the Conv1D weights ([in, out]) as rows
    of outputs, learned positions in F32, LayerNorm epsilon and no RoPE keys; transformers' loader reads it."""
    from gguf import GGUFReader

    from architectures import save_architecture

    # transformers' GGUF loader ignores gpt2.context_length (takes GPT2Config's default 1024 positions)
    model = save_architecture("gpt2", tmp_path / "gpt2", tiny_tokenizer, n_positions=1024)
    _, out = export(model, tmp_path, Target.q8_0)
    fields = read_fields(out)
    assert fields["general.architecture"] == "gpt2" and fields["gpt2.context_length"] == 1024
    assert fields["gpt2.feed_forward_length"] == 4 * 64 and fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert not [k for k in fields if ".rope." in k]
    tensors = {t.name: ([int(d) for d in t.shape], t.tensor_type.name) for t in GGUFReader(str(out)).tensors}
    assert tensors["blk.0.attn_qkv.weight"] == ([64, 3 * 64], "Q8_0") and tensors["blk.0.ffn_down.weight"] == ([256, 64], "Q8_0")
    assert tensors["position_embd.weight"] == ([64, 1024], "F32") and "output.weight" not in tensors  # tied
    assert {"blk.1.attn_norm.bias", "blk.1.ffn_up.bias", "output_norm.bias"} <= set(tensors)
    _assert_transformers_reads_the_decoded_weights(model, out)


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny_tokenizer):
    from transformers import OPTConfig

    config = OPTConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                       word_embed_proj_dim=32)
    model = save_random_model(config, tmp_path / "opt", tiny_tokenizer)
    msg = one_line_error(export_gguf, ExportConfig(model, tmp_path / "x.gguf", Target.q8_0))
    assert "'opt'" in msg and "llama" in msg
    assert not (tmp_path / "x.gguf").exists()


def test_gpt2_with_exact_gelu_is_refused(tmp_path, tiny_tokenizer):
    from architectures import save_architecture

    model = save_architecture("gpt2", tmp_path / "gpt2", tiny_tokenizer, activation_function="gelu")
    msg = one_line_error(export_gguf, ExportConfig(model, tmp_path / "x.gguf", Target.q8_0))
    assert "gelu_new" in msg and "'gelu'" in msg


def test_existing_output_needs_overwrite(tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep")
    msg = one_line_error(export_gguf, ExportConfig(REFERENCE_MODEL, out, Target.q8_0))
    assert "--overwrite" in msg and out.read_bytes() == b"keep"


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    import compress.export.encoding_pool as export_module  # where the export calls the encoder

    calls = {"n": 0}
    real = export_module.encode_tensor

    def failing(w, kind, importance=None):
        calls["n"] += 1
        if calls["n"] == 5:
            raise CompressError("simulated failure")
        return real(w, kind, importance)

    monkeypatch.setattr(export_module, "encode_tensor", failing)
    with pytest.raises(CompressError):
        export_gguf(ExportConfig(REFERENCE_MODEL, tmp_path / "x.gguf", Target.q8_0))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("late", [False, True], ids=["during", "after-the-last-tensor"])
def test_a_config_check_failing_while_tensors_are_written_stops_the_export(tmp_path, monkeypatch, late):
    """config.json is checked against the weights beside the encoding: its error is the export's, raised as soon as
    it is known (or before the rename, when it comes after the last tensor), and the output is removed."""
    import threading

    import compress.export.gguf as export_module

    written, total = threading.Event(), {"seen": 0}

    def progress(stage, done, count):
        total["seen"] = done
        if done == (count if late else 1):
            written.set()

    def check(path):
        written.wait(60)
        raise CompressError("config.json implies another shape")

    monkeypatch.setattr(export_module, "open_model", check)
    with pytest.raises(CompressError, match="implies another shape"):
        export_gguf(ExportConfig(REFERENCE_MODEL, tmp_path / "x.gguf", Target.q8_0), progress)
    assert list(tmp_path.iterdir()) == []
    assert total["seen"] > 1 if late else total["seen"] >= 1


def test_mixed_preset_follows_llama_cpp_rules(tmp_path):
    """Q4_K_M on the 4-block reference model: attn_v and ffn_down get Q6_K on llama.cpp's
    use_more_bits layers (i >= 7n/8 or (i - n/8) % 3 == 2, i.e. blocks 2 and 3), output Q6_K."""
    _, out = export(REFERENCE_MODEL, tmp_path, Target.q4_k_m)
    types = tensor_types(out)
    for i in range(4):
        want = "Q6_K" if i in (2, 3) else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == want and types[f"blk.{i}.ffn_down.weight"] == want
        assert types[f"blk.{i}.attn_q.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert read_fields(out)["general.file_type"] == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


def test_permutation_matches_llama_cpp_convention():
    """GGML pairs dimension i with i + d/2 of each head as (2i, 2i+1): row j of the first half of a
    head moves to 2j, row j of the second half to 2j + 1."""
    w = torch.arange(2 * 8, dtype=torch.float32).reshape(-1, 1).repeat(1, 3)  # 2 heads of 8 rows
    p = permute_rope(w, 2)
    head = [0, 4, 1, 5, 2, 6, 3, 7]
    assert p[:, 0].tolist() == head + [8 + h for h in head]
    assert np.array_equal(p.sum(0).numpy(), w.sum(0).numpy())


def test_sentencepiece_style_tokenizer_is_written_as_llama_vocab(sentencepiece_llama, tmp_path):
    from transformers import AutoTokenizer

    _, out = export(sentencepiece_llama, tmp_path, Target.q8_0)
    f = read_fields(out)
    assert f["tokenizer.ggml.model"] == "llama"
    tokens, types, scores = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"], f["tokenizer.ggml.scores"]
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [2, 3, 3]  # unknown, control, control
    assert tokens[3] == "<0x00>" and types[3] == 6  # byte-fallback pieces are BYTE tokens
    assert "tokenizer.ggml.merges" not in f and len(scores) == len(tokens)
    assert f["tokenizer.ggml.bos_token_id"] == 1 and f["tokenizer.ggml.eos_token_id"] == 2
    ours = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
    hf = AutoTokenizer.from_pretrained(sentencepiece_llama)
    text = "KING RICHARD III:\nNow is the winter of our discontent"
    assert ours(text, add_special_tokens=False)["input_ids"] == hf(text, add_special_tokens=False)["input_ids"]


def test_cli_export_and_imatrix(tmp_path):
    from typer.testing import CliRunner

    from compress.cli import app

    runner = CliRunner()
    out = tmp_path / "ref.gguf"
    res = runner.invoke(app, ["export", str(REFERENCE_MODEL), "-o", str(out), "--type", "q4_k_m", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["type"] == "q4_k_m" and summary["file_bytes"] == out.stat().st_size
    assert 4.5 < summary["bits_per_weight"] < 5.5
    im = tmp_path / "im.gguf"
    res = runner.invoke(app, ["imatrix", str(REFERENCE_MODEL), "--calib", str(CALIB_TEXT), "-o", str(im), "--samples", "2", "--seq-len", "64", "--json"])
    assert res.exit_code == 0, res.output
    out2 = tmp_path / "ref-im.gguf"
    res = runner.invoke(app, ["export", str(REFERENCE_MODEL), "-o", str(out2), "--type", "q4_0", "--method", "imatrix", "--imatrix", str(im)])
    assert res.exit_code == 0, res.output
    assert read_fields(out2)["quantize.imatrix.entries_count"] == 28


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--type", "q4_z"], "unknown GGUF type"),
        (["--format", "safetensors"], "--format gguf"),
        (["--method", "gptq"], "--calib"),
        (["--method", "bogus"], "unknown GGUF export method"),
        (["--calib", "x.txt"], "--method"),
        (["--method", "imatrix"], "--imatrix"),
        (["--imatrix", "x.gguf"], "--method imatrix"),
        (["-O", "damp=0.1"], "drop -O"),
        (["--method", "gptq", "--calib", str(CALIB_TEXT), "-O", "asymetric=true"], "no setting 'asymetric'"),
        (["--method", "awq", "--calib", str(CALIB_TEXT), "-O", "damp=0.1"], "no setting 'damp'"),
        (["--method", "gptq", "--calib", str(CALIB_TEXT), "-O", "damp=-1"], "damp"),
        (["--method", "gptq", "--calib", str(CALIB_TEXT), "-O", "damp"], "KEY=VALUE"),
    ],
)
def test_cli_export_errors_are_one_line(tmp_path, args, needle):
    from typer.testing import CliRunner

    from compress.cli import app

    res = CliRunner().invoke(app, ["export", str(REFERENCE_MODEL), "-o", str(tmp_path / "x.gguf"), *args])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.output
    assert not (tmp_path / "x.gguf").exists()


def test_recipe_export_section_writes_the_compressed_checkpoint_as_gguf(tmp_path):
    """rtn w4 (dense "fake" output), then ``export: {type: f16}``: the GGUF file holds the quantized
    checkpoint's weights, so transformers' logits from it match the checkpoint's within f16 rounding."""
    from transformers import AutoModelForCausalLM

    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe

    out, gguf_path = tmp_path / "rtn", tmp_path / "rtn-f16.gguf"
    recipe = parse_recipe({
        "model": str(REFERENCE_MODEL),
        "stages": [{"method": "rtn", "bits": 4, "group_size": 128}],
        "output": {"path": str(out), "format": "fake"},
        "export": {"path": str(gguf_path), "type": "f16"},
    })
    run_recipe(recipe)
    ids = torch.arange(1, 65).reshape(1, -1)
    with torch.no_grad():
        a = transformers_model(gguf_path)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    assert torch.allclose(a, b, atol=2e-2, rtol=1e-3), (a - b).abs().max()
    assert read_fields(gguf_path)["general.file_type"] == 1


def test_recipe_export_section_is_validated():
    from compress.run.recipe import parse_recipe

    base = {"model": str(REFERENCE_MODEL), "stages": [{"method": "rtn"}], "output": {"path": "x", "format": "fake"}}
    msg = one_line_error(parse_recipe, {**base, "export": {"path": "x.gguf", "type": "q9_k"}})
    assert "export.type" in msg and "q4_k_m" in msg
    msg = one_line_error(parse_recipe, {**base, "export": {"path": "x.gguf", "method": "imatrix"}})
    assert "imatrix" in msg
    msg = one_line_error(parse_recipe, {**base, "export": {"path": "x.gguf", "bits": 4}})
    assert "unknown key 'export.bits'" in msg and "valid keys" in msg
