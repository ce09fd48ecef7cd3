"""The CLI end to end: three architectures, recipes, and every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config
from typer.testing import CliRunner

from compress.cli import app
from conftest import CALIB_TEXT, EVAL_TEXT, save_random_model, tiny_llama_config

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def architectures(vocab: int):
    return {
        "llama": tiny_llama_config(vocab),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, bos_token_id=0, eos_token_id=0),
        "qwen2": Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        ),
    }


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_inspect_and_quantize_three_architectures(arch, tmp_path, tiny_tokenizer):
    model_dir = save_random_model(architectures(len(tiny_tokenizer))[arch], tmp_path / arch, tiny_tokenizer)
    result = invoke("inspect", model_dir, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    expected_blocks = {"llama": "model.layers", "gpt2": "transformer.h", "qwen2": "model.layers"}[arch]
    assert info["decoder_blocks"] == {"path": expected_blocks, "count": 2, "class": info["decoder_blocks"]["class"]}
    assert info["quantizable_layers"] == {"llama": 14, "gpt2": 8, "qwen2": 14}[arch]
    assert info["compression"] is None

    out = tmp_path / "out"
    short_text = tmp_path / "eval.txt"
    short_text.write_text(EVAL_TEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    result = invoke(
        "quantize", model_dir, "-o", out, "--bits", "8", "--group-size", "32",
        "--eval-text", short_text, "--json",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert len(summary["layers"]) == info["quantizable_layers"]
    assert summary["evaluation"]["kld"] < 1e-3  # 8-bit barely moves a random model
    assert (out / "tokenizer.json").is_file()
    assert (out / "README.md").read_text().startswith("# out\n")
    config = json.loads((out / "config.json").read_text())
    assert config["compression"]["stages"] == [{"method": "rtn", "bits": 8, "group_size": 32, "symmetric": True}]
    # transformers loads it, and it is close to the original.
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    quantized = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, len(tiny_tokenizer), (1, 16))
    with torch.no_grad():
        assert (quantized(x).logits - original(x).logits).abs().max() < 0.05
    info = json.loads(invoke("inspect", out, "--json").stdout)
    assert info["compression"]["stages"][0]["bits"] == 8


def test_recipe_equals_command_line(tmp_path, tiny_llama):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tiny_llama}\nstages:\n  - method: rtn\n    bits: 3\n    group_size: 32\n"
        f"output: {{path: {tmp_path / 'a'}}}\n"
    )
    assert invoke("run", recipe).exit_code == 0
    assert invoke("quantize", tiny_llama, "-o", tmp_path / "b", "--bits", "3", "--group-size", "32").exit_code == 0
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_ppl_reports_kld(tiny_llama, tmp_path):
    invoke("quantize", tiny_llama, "-o", tmp_path / "q", "--bits", "2", "--group-size", "32")
    result = invoke("eval", "ppl", tmp_path / "q", "--text", EVAL_TEXT, "--reference", tiny_llama,
                    "--ctx", "64", "--max-tokens", "600", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["tokens_scored"] == 599 and data["kld"] > 0 and data["perplexity"] > 1


# --- bad input: one line, exit code != 0, nothing written ---------------------------------------

def truncated_model(tmp_path: Path, source: Path) -> Path:
    bad = tmp_path / "truncated"
    bad.mkdir()
    for f in source.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[: len(data) - 1000] if f.suffix == ".safetensors" else data)
    return bad


def bad_inputs(tmp_path: Path, model: Path) -> dict[str, tuple[list, str]]:
    (tmp_path / "no-config").mkdir()
    (tmp_path / "existing").mkdir()
    (tmp_path / "empty.txt").write_text("  \n")
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"model: {model}\nstages:\n  - method: rtn\noutput: {{path: {tmp_path / 'o'}}}\nevaluaton: {{}}\n")
    out = tmp_path / "o"
    return {
        "missing path": (["quantize", tmp_path / "nope", "-o", out], "does not exist"),
        "no config.json": (["quantize", tmp_path / "no-config", "-o", out], "no config.json"),
        "truncated safetensors": (["quantize", truncated_model(tmp_path, model), "-o", out], "truncated"),
        "bit width": (["quantize", model, "-o", out, "--bits", "9"], "bits"),
        "group size": (["quantize", model, "-o", out, "--group-size", "48"], "group size 48 does not divide"),
        "existing output": (["quantize", model, "-o", tmp_path / "existing"], "--overwrite"),
        # (group size 32: the tiny model's 64-wide layers take it, so the calibration set is the one fault)
        "empty calibration": (["quantize", model, "-o", out, "--group-size", "32", "--calib", tmp_path / "empty.txt"], "empty"),
        "unknown recipe key": (["run", recipe], "unknown key 'evaluaton'"),
    }


CASES = ["missing path", "no config.json", "truncated safetensors", "bit width", "group size",
         "existing output", "empty calibration", "unknown recipe key"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_error_and_writes_nothing(case, tmp_path, tiny_llama):
    args, needle = bad_inputs(tmp_path, tiny_llama)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(*args)
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no partial directory
    assert not any(tmp_path.glob(".*partial*"))


def test_console_script_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "compress.cli", "quantize", tmp_path / "missing", "-o", tmp_path / "o"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: model path") and "\n" not in proc.stderr.strip()


def test_calibrated_run_from_shipped_calibration_slice(tmp_path, tiny_llama):
    """--calib with a method that needs no data is still validated and the run succeeds."""
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "--group-size", "32",
                    "--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "64")
    assert result.exit_code == 0, result.output


def test_reference_model_command_trains_and_writes_card(tmp_path):
    short_text = tmp_path / "eval.txt"
    short_text.write_text(EVAL_TEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    out = tmp_path / "ref"
    result = invoke("reference-model", "-o", out, "--corpus", CALIB_TEXT, "--steps", "2", "--eval-text", short_text)
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert "| eval.txt |" in card and "2 steps" in card
    assert json.loads((out / "training.json").read_text())["config"]["steps"] == 2
    assert AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 2


def test_gptq_command_reports_each_layer(tmp_path, tiny_llama):
    out = tmp_path / "gptq"
    result = invoke("quantize", tiny_llama, "-o", out, "--method", "gptq", "--bits", "4", "--group-size", "32",
                    "-O", "act_order=true", "-O", "damp=0.05", "--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "64")
    assert result.exit_code == 0, result.output
    assert "model.layers.1.mlp.down_proj  [64×128]" in result.stderr  # the live per-layer table
    rows = json.loads((out / "compression_report.json").read_text())["layers"]
    assert len(rows) == 14
    assert all(r["info"]["damp"] == 0.05 and r["info"]["error"] >= 0 for r in rows)
    stage = json.loads((out / "config.json").read_text())["compression"]["stages"][0]
    assert stage["method"] == "gptq" and stage["act_order"] is True and stage["true_sequential"] is True


def test_gptq_without_calibration_is_a_clear_error(tmp_path, tiny_llama):
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "--method", "gptq", "--group-size", "32")
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: method gptq needs calibration data: pass --calib PATH"


@pytest.mark.parametrize("command", [["export", "--type", "q8_0"], ["export", "--method", "imatrix", "--calib", CALIB_TEXT],
                                     ["imatrix", "--calib", CALIB_TEXT]])
def test_a_compute_dtype_that_names_no_choice_is_a_clear_error(tmp_path, tiny_llama, command):
    out = tmp_path / "out.gguf"
    result = invoke(command[0], tiny_llama, "-o", out, *command[1:], "--compute-dtype", "fp8")
    assert result.exit_code == 2 and not out.exists()
    assert result.stderr.strip() == "error: --compute-dtype fp8: use one of auto, float32, bfloat16, float16"


def test_bad_method_option_is_a_clear_error(tmp_path, tiny_llama):
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "-O", "act_order")
    assert result.exit_code == 2 and "is not KEY=VALUE" in result.stderr


@pytest.mark.parametrize("method,target", [("sparsegpt", ["--pattern", "2:4"]), ("wanda", ["--sparsity", "0.5"]),
                                           ("magnitude", ["--pattern", "4:8"])])
def test_prune_then_inspect_reports_sparsity(method, target, tmp_path, tiny_llama):
    out = tmp_path / method
    result = invoke("prune", tiny_llama, "-o", out, "--method", method, *target,
                    "--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "64")
    assert result.exit_code == 0, result.output
    assert "model.layers.1.mlp.down_proj  [64×128]" in result.stderr and "sparsity=0.5" in result.stderr
    rows = json.loads((out / "compression_report.json").read_text())["layers"]
    assert len(rows) == 14 and all(r["info"]["sparsity"] == pytest.approx(0.5, abs=1e-3) for r in rows)
    stage = json.loads((out / "config.json").read_text())["compression"]["stages"][0]
    assert stage["method"] == method
    assert stage["pattern"] == (target[1] if target[0] == "--pattern" else None)

    info = json.loads(invoke("inspect", out, "--json").stdout)
    assert info["sparsity"]["zeros"] == pytest.approx(0.5, abs=1e-3)
    expected = {"2:4": {"2:4": True, "4:8": True}, "4:8": {"2:4": False, "4:8": True}}.get(target[1], {"2:4": False, "4:8": False})
    assert info["sparsity"]["nm"] == expected
    assert info["sparsity"]["pattern"] == next((p for p, ok in expected.items() if ok), None)
    assert "50.00% zeros" in invoke("inspect", out).stdout
    original = json.loads(invoke("inspect", tiny_llama, "--json").stdout)["sparsity"]
    assert original == {"zeros": 0.0, "nm": {"2:4": False, "4:8": False}, "pattern": None, "layers_measured": 14}


@pytest.mark.parametrize("args,needle", [
    (["--pattern", "2-4"], "pattern '2-4' is not N:M"),
    (["--pattern", "4:2"], "pattern '4:2' is not N:M"),
    (["--pattern", "2:4", "--sparsity", "0.5"], "give exactly one of sparsity"),
    ([], "give exactly one of sparsity"),
    (["--pattern", "3:5", "--method", "magnitude"], "N:M group size 5 does not divide in_features 64"),
])
def test_bad_prune_target_is_one_line_error(args, needle, tmp_path, tiny_llama):
    result = invoke("prune", tiny_llama, "-o", tmp_path / "o", *args)
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert not (tmp_path / "o").exists()


def test_prune_joint_quantization_keeps_pattern_and_grid(tmp_path, tiny_llama):
    out = tmp_path / "joint"
    result = invoke("prune", tiny_llama, "-o", out, "--pattern", "2:4", "-O", "bits=4", "-O", "group_size=32",
                    "--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "64", "--format", "fake")  # dense: read back
    assert result.exit_code == 0, result.output
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    w = weights["model.layers.0.mlp.down_proj.weight"]  # [64, 128]
    assert ((w != 0).reshape(64, -1, 4).sum(dim=2) <= 2).all()
    groups = w.reshape(64, -1, 32)
    assert all(len(set(g.tolist()) | {0.0}) <= 16 for row in groups for g in row)  # 4-bit symmetric grid with 0
    stage = json.loads((out / "config.json").read_text())["compression"]["stages"][0]
    assert (stage["method"], stage["pattern"], stage["bits"], stage["group_size"]) == ("sparsegpt", "2:4", 4, 32)


def test_methods_lists_every_setting_with_its_default_as_typed():
    from compress.engine.registry import method_class, method_names

    result = runner.invoke(app, ["methods"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Undefined" not in text
    for name in method_names():
        for key in method_class(name).Config.model_fields:
            assert f"{key}=" in text, (name, key)
    assert "online=[]" in text and "full_range=True" in text and "full_range=False" in text
