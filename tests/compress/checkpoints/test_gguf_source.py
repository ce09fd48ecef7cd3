"""GGUF files as input models: `convert_gguf` against transformers' own GGUF loader, the CLI, and SmolLM2
(the real pretrained model) against llama.cpp running its original Q4_1 file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

pytest.importorskip("gguf")

from compress.checkpoints.gguf_source import ConvertDtype, checkpoint_source, convert_gguf  # noqa: E402
from compress.checkpoints.shards import CheckpointReader  # noqa: E402
from compress.cli import app  # noqa: E402
from compress.errors import CompressError  # noqa: E402
from compress.export.gguf import ExportConfig, export_gguf  # noqa: E402
from compress.formats.gguf.plan import Target  # noqa: E402
from conftest import EVAL_TEXT, REFERENCE_MODEL  # noqa: E402
from gguf_reference import transformers_model  # noqa: E402


@pytest.fixture(scope="module")
def reference_gguf(tmp_path_factory) -> Path:
    """The reference model as a Q4_K_M GGUF (Q4_K and Q6_K blocks, Q/K rows permuted for GGML's RoPE)."""
    path = tmp_path_factory.mktemp("gguf-in") / "reference-q4_k_m.gguf"
    export_gguf(ExportConfig(REFERENCE_MODEL, path, Target.q4_k_m))
    return path


def test_conversion_equals_transformers_gguf_loader(reference_gguf, tmp_path):
    """Every tensor equals what ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` builds."""
    result = convert_gguf(reference_gguf, tmp_path / "out")
    theirs = transformers_model(reference_gguf).state_dict()
    ours = CheckpointReader(tmp_path / "out")
    assert sorted(ours.names()) == sorted(theirs)
    for name in ours.names():
        assert torch.equal(ours.get(name), theirs[name].to(torch.float32)), name
    assert result.architecture == "llama" and result.source_types.keys() >= {"Q4_K", "Q6_K", "F32"}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    original = json.loads((REFERENCE_MODEL / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == original[key], key


def test_conversion_keeps_the_model_close_and_the_tokenizer_exact(reference_gguf, tmp_path):
    """Q4_K_M is lossy, so weights differ by quantization error only, and the tokenizer is the original's."""
    from transformers import AutoTokenizer

    convert_gguf(reference_gguf, tmp_path / "out", ConvertDtype.bfloat16)
    converted = load_file(tmp_path / "out" / "model.safetensors")
    original = CheckpointReader(REFERENCE_MODEL)
    w = original.get("model.layers.1.self_attn.q_proj.weight")  # permuted and back: must line up row by row
    got = converted["model.layers.1.self_attn.q_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.nn.functional.cosine_similarity(got.float().flatten(), w.flatten(), dim=0) > 0.99
    text = EVAL_TEXT.read_text(encoding="utf-8")[:3000]
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == AutoTokenizer.from_pretrained(REFERENCE_MODEL)(text)["input_ids"]


def test_bad_inputs_are_one_line_errors_and_write_nothing(tmp_path):
    import gguf

    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(CompressError, match="not a GGUF file"):
        convert_gguf(not_gguf, tmp_path / "a")
    rwkv = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(rwkv), "rwkv6")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CompressError, match=r"'rwkv6' model, which transformers cannot convert.*llama.*qwen2"):
        convert_gguf(rwkv, tmp_path / "b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rwkv.gguf", "weights.gguf"]


def test_cli_convert_and_quantize_a_gguf_directly(reference_gguf, tmp_path, monkeypatch):
    """`compress quantize MODEL.gguf` converts into a scratch directory, removes it, and records the GGUF."""
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    runner = CliRunner()
    done = runner.invoke(app, ["convert", str(reference_gguf), "-o", str(tmp_path / "conv"), "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["parameters"] > 4_000_000
    done = runner.invoke(app, ["quantize", str(reference_gguf), "-o", str(tmp_path / "q"), "--bits", "4", "--group-size", "64", "--format", "fake"])
    assert done.exit_code == 0, done.output
    record = json.loads((tmp_path / "q" / "config.json").read_text())["compression"]
    assert record["source_model"] == str(reference_gguf)
    assert list(scratch_root.iterdir()) == []  # the scratch conversion is gone
    quantized, converted = CheckpointReader(tmp_path / "q"), CheckpointReader(tmp_path / "conv")
    w = converted.get("model.layers.0.mlp.down_proj.weight")
    assert (quantized.get("model.layers.0.mlp.down_proj.weight") - w).abs().max() < w.abs().max() / 4
    bad = runner.invoke(app, ["convert", str(reference_gguf), "-o", str(tmp_path / "conv")])
    assert bad.exit_code == 2 and "exists" in bad.output


def test_checkpoint_source_passes_directories_through():
    with checkpoint_source(REFERENCE_MODEL) as path:
        assert path == REFERENCE_MODEL


# -- SmolLM2-135M-Instruct ------------------------------------------------------------------------------
def test_smollm2_is_the_real_model(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in CheckpointReader(smollm2).names()


def test_smollm2_conversion_agrees_with_llama_cpp_on_the_original_file(smollm2, llama_cpp_runs):
    """Our float checkpoint (transformers) and llama.cpp running the shipped Q4_1 file itself score the same
    Shakespeare tokens within 1% perplexity (llama.cpp rounds activations to 8 bits in its Q4_1 dot products)."""
    from transformers import AutoTokenizer

    from compress.checkpoints.loading import load_model
    from compress.eval.perplexity import evaluate
    from conftest import smollm2_gguf
    from gguf_reference import llamacpp_perplexity

    ids = AutoTokenizer.from_pretrained(smollm2)(EVAL_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:1024]
    ours = evaluate(load_model(smollm2, torch.device("cpu")), torch.tensor(ids), ctx=512).perplexity
    theirs = llamacpp_perplexity(smollm2_gguf(), ids, ctx=512)
    assert ours < 60, ours  # a trained model on English verse (a random one: ~49152)
    assert abs(theirs / ours - 1) < 0.01, (theirs, ours)


def test_lying_gguf_headers_are_one_line_errors(reference_gguf, tmp_path):
    """Counts, string lengths and versions that lie, and random byte flips in the header and tensor infos:
    every one converts (a harmless flip) or is a CompressError, never another exception or a huge allocation."""
    import random
    import struct

    source = reference_gguf.read_bytes()
    patches = [(8, struct.pack("<Q", 1 << 40)), (16, struct.pack("<Q", 1 << 40)), (24, struct.pack("<Q", 1 << 50)), (4, struct.pack("<I", 99))]
    rng = random.Random(0)
    patches += [(pos, bytes([rng.randrange(256)])) for pos in sorted(rng.sample(range(24, 40000), 12))]
    outcomes = {"error": 0, "converted": 0}
    for pos, patch in patches:
        broken = tmp_path / "broken.gguf"
        broken.write_bytes(source[:pos] + patch + source[pos + len(patch):])
        try:
            convert_gguf(broken, tmp_path / "out", overwrite=True)
            outcomes["converted"] += 1
        except CompressError as exc:
            assert "\n" not in str(exc) and "broken.gguf" in str(exc)
            outcomes["error"] += 1
    assert outcomes["error"] >= 4  # at least the four lies
