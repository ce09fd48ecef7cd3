"""`group_size: auto`: the largest of 128/64/32 dividing every selected layer, said in the run's notes."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from compress.checkpoints.shards import CheckpointReader
from compress.cli import app
from conftest import save_random_model, tiny_llama_config


def test_auto_group_size_on_a_width_of_576(smollm2_2, tmp_path):
    """SmolLM2's 576 is a multiple of 64, not of 128: auto takes 64, and 128 is the clear error it always was."""
    runner = CliRunner()
    args = ["quantize", str(smollm2_2), "--bits", "4", "--format", "fake", "--json"]
    done = runner.invoke(app, [*args, "-o", str(tmp_path / "auto"), "--group-size", "auto"])
    assert done.exit_code == 0, done.output
    notes = json.loads(done.stdout)["notes"]
    assert notes == ["stage 1 (rtn): group size auto chose 64 (in_features 576, 1536)"]
    record = json.loads((tmp_path / "auto" / "config.json").read_text())["compression"]
    assert record["stages"][0]["group_size"] == 64
    w = CheckpointReader(tmp_path / "auto").get("model.layers.0.self_attn.q_proj.weight")
    assert all(len(group.unique()) <= 16 for group in w[:4].reshape(-1, 64))  # 4-bit codes per group of 64
    refused = runner.invoke(app, [*args, "-o", str(tmp_path / "g128"), "--group-size", "128"])
    assert refused.exit_code == 2 and "does not divide in_features 576" in refused.output


def test_auto_group_size_without_a_divisor_is_a_one_line_error(tmp_path, tiny_tokenizer):
    model = save_random_model(tiny_llama_config(len(tiny_tokenizer), hidden_size=72, num_attention_heads=4, num_key_value_heads=2),
                              tmp_path / "m", tiny_tokenizer)
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(tmp_path / "o"), "--group-size", "auto"])
    assert done.exit_code == 2
    assert "none of 128, 64, 32 divides every selected layer's in_features (72, 128)" in done.output
    assert not (tmp_path / "o").exists()


def test_a_layer_the_method_cannot_take_fails_before_the_calibration_is_tokenized(tmp_path, tiny_tokenizer, monkeypatch):
    """The group-size error comes from the layers alone: no calibration set is read for it (a large corpus takes
    seconds to tokenize)."""
    from compress.run import compression

    model = save_random_model(tiny_llama_config(len(tiny_tokenizer)), tmp_path / "m", tiny_tokenizer)
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox " * 200)
    read, load = [], compression.load_calibration
    monkeypatch.setattr(compression, "load_calibration", lambda *a, **k: read.append(a) or load(*a, **k))
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(tmp_path / "o"), "--method", "gptq",
                                    "--group-size", "48", "--calib", str(text), "--samples", "2", "--seq-len", "16"])
    assert done.exit_code == 2 and "group size 48 does not divide in_features 64" in done.output
    assert read == [] and not (tmp_path / "o").exists()
