"""Our loader for packed outputs: QuantLinear layers, clear errors on tampered files, inspect, eval."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from conftest import EVAL_TEXT, REFERENCE_MODEL
from references import one_line_error
from compress.cli import app
from compress.errors import CompressError
from compress.checkpoints.loading import load_model
from compress.kernels.quant_linear import QuantLinear
from compress.checkpoints.packed import load_packed_model
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe


def quantize(model: Path, out: Path, fmt: str, stages: list[dict] | None = None, **stage) -> Path:
    stages = stages or [{"method": "rtn", "bits": 4, "group_size": 32, **stage}]
    run_recipe(parse_recipe({"model": model, "stages": stages, "output": {"path": out, "format": fmt}}))
    return out


@pytest.fixture
def packed_pair(tmp_path, tiny_llama):
    return {fmt: quantize(tiny_llama, tmp_path / fmt, fmt, symmetric=False) for fmt in ("compressed-tensors", "gptq", "fake")}


def test_loader_swaps_quantized_layers_for_quantlinear(packed_pair):
    fake = load_model(packed_pair["fake"], torch.device("cpu"))
    x = torch.randint(0, 200, (2, 12))
    for fmt in ("compressed-tensors", "gptq"):
        model = load_model(packed_pair[fmt], torch.device("cpu"))
        layers = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 14 and "lm_head" not in layers
        with torch.no_grad():
            diff = (model(x).logits - fake(x).logits).abs().max()
        assert diff <= (1e-5 if fmt == "compressed-tensors" else 5e-3)  # gptq stores fp16 scales


def _rewrite(path: Path, change) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("fmt,key,change", [
    ("compressed-tensors", "weight_scale", "drop"),
    ("compressed-tensors", "weight_zero_point", "drop"),
    ("compressed-tensors", "weight_packed", "shrink"),
    ("compressed-tensors", "weight_shape", "lie"),
    ("gptq", "scales", "drop"),
    ("gptq", "qweight", "shrink"),
    ("gptq", "qzeros", "shrink"),
])
def test_tampered_files_are_clear_errors(packed_pair, fmt, key, change):
    path = packed_pair[fmt]
    target = f"model.layers.1.mlp.up_proj.{key}"

    def edit(tensors):
        if change == "drop":
            del tensors[target]
        elif change == "shrink":
            tensors[target] = tensors[target][:-1].contiguous()
        else:
            tensors[target] = torch.tensor([1, 2], dtype=torch.int64)

    _rewrite(path, edit)
    msg = one_line_error(load_model, path, torch.device("cpu"))
    assert target in msg


def test_truncated_packed_file_is_a_clear_error(packed_pair):
    weights = packed_pair["compressed-tensors"] / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    assert "truncated" in one_line_error(load_model, packed_pair["compressed-tensors"], torch.device("cpu"))


def test_config_and_tensors_must_agree(packed_pair):
    path = packed_pair["compressed-tensors"]
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"].append("model.layers.0.mlp.down_proj")
    (path / "config.json").write_text(json.dumps(config))
    assert "model.layers.0.mlp.down_proj" in one_line_error(load_packed_model, path)
    config["quantization_config"]["quantization_status"] = "frozen"
    (path / "config.json").write_text(json.dumps(config))
    assert "compressed" in one_line_error(load_packed_model, path)


def test_packed_input_cannot_be_compressed_again(packed_pair, tmp_path):
    msg = one_line_error(quantize, packed_pair["gptq"], tmp_path / "again", "fake")
    assert "already quantized" in msg


@pytest.mark.parametrize("fmt,expected", [("compressed-tensors", 4 + 32 / 128), ("gptq", 4 + (16 + 4) / 128)])
def test_inspect_reports_format_and_bits_per_weight_near_theory(fmt, expected, tmp_path):
    """4-bit g128 on the reference model: on-disk bits per weight within 3% of 4 + (scale + zero bits) / 128
    (compressed-tensors keeps the fp32 model's scale dtype; gptq has fp16 scales, 4-bit zeros, and g_idx)."""
    out = quantize(REFERENCE_MODEL, tmp_path / fmt, fmt, bits=4, group_size=128)
    result = CliRunner().invoke(app, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    storage = json.loads(result.stdout)["storage"]
    assert storage["format"].startswith(fmt)
    assert storage["packed_layers"] == 28
    assert storage["packed_bits_per_weight"] == pytest.approx(expected, rel=0.03)
    text = CliRunner().invoke(app, ["inspect", str(out)]).stdout
    assert "bits per weight" in text and fmt in text


def test_inspect_of_dense_checkpoint_says_dense(tiny_llama):
    info = json.loads(CliRunner().invoke(app, ["inspect", str(tiny_llama), "--json"]).stdout)
    assert info["storage"]["format"] == "dense" and info["storage"]["bits_per_weight"] == 32


def test_eval_ppl_on_packed_output_equals_fake(packed_pair, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(EVAL_TEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    ppl = {}
    for fmt in ("compressed-tensors", "fake"):
        result = CliRunner().invoke(app, ["eval", "ppl", str(packed_pair[fmt]), "--text", str(text), "--ctx", "64", "--json"])
        assert result.exit_code == 0, result.output
        ppl[fmt] = json.loads(result.stdout)["perplexity"]
    assert ppl["compressed-tensors"] == pytest.approx(ppl["fake"], rel=1e-5)


def test_a_layer_changed_after_quantization_is_written_dense(tmp_path, tiny_llama, caplog):
    stages = [{"method": "rtn", "bits": 4, "group_size": 32}, {"method": "magnitude", "sparsity": 0.5, "include": ["mlp"]}]
    with caplog.at_level(logging.WARNING):
        out = quantize(tiny_llama, tmp_path / "mixed", "compressed-tensors", stages=stages)
    stored = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.mlp.up_proj.weight" in stored and "model.layers.0.mlp.up_proj.weight_packed" not in stored
    assert "model.layers.0.self_attn.q_proj.weight_packed" in stored
    assert "written dense" in caplog.text
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.up_proj" in qc["ignore"]
    load_model(out, torch.device("cpu"))  # mixed packed/dense loads


def test_requantizing_a_layer_packs_the_last_codes(tmp_path, tiny_llama):
    stages = [{"method": "rtn", "bits": 8, "group_size": 32}, {"method": "rtn", "bits": 4, "group_size": 32}]
    out = quantize(tiny_llama, tmp_path / "twice", "compressed-tensors", stages=stages)
    fake = quantize(tiny_llama, tmp_path / "twice-fake", "fake", stages=stages)
    a, b = load_model(out, torch.device("cpu")), load_model(fake, torch.device("cpu"))
    x = torch.randint(0, 200, (1, 10))
    with torch.no_grad():
        assert (a(x).logits - b(x).logits).abs().max() <= 1e-5


def test_format_option_is_validated(tmp_path, tiny_llama):
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "-o", str(tmp_path / "x"), "--format", "gguf"])
    assert result.exit_code == 2 and "format" in result.output
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "-o", str(tmp_path / "x"), "--format", "gptq", "--bits", "5"])
    assert result.exit_code == 2 and "gptq" in result.output and not (tmp_path / "x").exists()
    with pytest.raises(CompressError):
        parse_recipe({"model": tiny_llama, "stages": [{"method": "rtn"}], "output": {"path": tmp_path / "y", "format": "int4"}})
