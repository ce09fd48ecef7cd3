"""Tests for compress.engine.journal: a run continued from its progress record writes the bytes of a run never
interrupted, and a changed setting, model or calibration set is refused naming the difference.

A kill right after block k's record is simulated in-process: the temporary directory is copied, as it is at that
moment, to the name a killed run leaves (``.out.partial-PID``). (Real SIGKILLs: tests/compress/cli/test_faults.py.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from compress.checkpoints.output import PROGRESS
from compress.cli import app
from compress.engine.journal import BlockJournal, _difference, fingerprint
from conftest import CALIB_TEXT, save_random_model, tiny_llama_config

CALIB = ["--calib", str(CALIB_TEXT), "--samples", "4", "--seq-len", "32"]
DEAD_PID = 999_999  # the killed run's (no such process: its lock is free)


@pytest.fixture(scope="module")
def three_blocks(tmp_path_factory, tiny_tokenizer) -> Path:
    return save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=3), tmp_path_factory.mktemp("three") / "m", tiny_tokenizer)


def _digests(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def _killed_after(block: int, argv: list[str], out: Path, monkeypatch) -> Path:
    """Run ``argv`` to the end, keeping a copy of its temporary directory as it was right after block
    ``block``'s record; return where that copy lies (as a run killed there leaves it) and remove the output."""
    record = BlockJournal.block_done
    killed = out.parent / f".{out.name}.partial-{DEAD_PID}"

    def done(self, index, *args):
        record(self, index, *args)
        if index == block:
            shutil.copytree(self.root.parent, killed)

    with monkeypatch.context() as patch:
        patch.setattr(BlockJournal, "block_done", done)
        finished = CliRunner().invoke(app, argv)
    assert finished.exit_code == 0, finished.output
    shutil.rmtree(out)
    return killed


METHODS = {"gptq": ["--method", "gptq", "--group-size", "32"], "smoothquant-kv": ["--method", "smoothquant", "--kv-cache", "fp8"],
           "gptq-asymmetric": ["--method", "gptq", "--group-size", "32", "-O", "asymmetric=true"]}


@pytest.mark.parametrize("case", sorted(METHODS))
def test_a_resumed_run_writes_the_bytes_of_an_uninterrupted_one(tmp_path, three_blocks, monkeypatch, case):
    """GPTQ packed; SmoothQuant with KV-cache scales: what the method (input scales of every layer, in the record)
    and the observer (maxima over every block) learned before the kill is restored; asymmetric GPTQ: the original
    model's block inputs too."""
    out = tmp_path / "out"
    method = METHODS[case]
    argv = ["quantize", str(three_blocks), "-o", str(out), *method, *CALIB, "--json"]
    done = CliRunner().invoke(app, argv)
    assert done.exit_code == 0, done.output
    whole = _digests(out)
    shutil.rmtree(out)
    killed = _killed_after(0, argv, out, monkeypatch)
    assert json.loads((killed / PROGRESS / "progress.json").read_text())["block"] == 0
    resumed = CliRunner().invoke(app, [*argv, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert [r["name"] for r in json.loads(resumed.stdout)["layers"]] == [r["name"] for r in json.loads(done.stdout)["layers"]]
    assert _digests(out) == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the killed run's directory became the output


def test_records_that_would_cost_too_much_are_skipped_and_the_run_resumes_from_the_last_one(tmp_path, three_blocks, monkeypatch):
    """With records allowed a vanishing share of the run's time, block 1 (neither the first nor the last) is not
    recorded: a kill after it leaves block 0's record, and the resumed run redoes block 1 to the same bytes."""
    import compress.engine.journal as journal

    out = tmp_path / "out"
    argv = ["quantize", str(three_blocks), "-o", str(out), "--method", "gptq", "--group-size", "32", *CALIB]
    assert CliRunner().invoke(app, argv).exit_code == 0
    whole = _digests(out)
    shutil.rmtree(out)
    monkeypatch.setattr(journal, "RECORD_SHARE", 1e-9)
    killed = _killed_after(1, argv, out, monkeypatch)
    assert json.loads((killed / PROGRESS / "progress.json").read_text())["block"] == 0
    resumed = CliRunner().invoke(app, [*argv, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert _digests(out) == whole


def test_a_changed_setting_is_refused_naming_it(tmp_path, three_blocks, monkeypatch):
    out = tmp_path / "out"
    argv = ["quantize", str(three_blocks), "-o", str(out), "--method", "gptq", "--group-size", "32", *CALIB]
    killed = _killed_after(1, argv, out, monkeypatch)
    before = _digests(killed)
    changed = CliRunner().invoke(app, [*argv, "--samples", "8", "--bits", "3", "--resume"])  # 8 calibration windows, 3 bits
    assert changed.exit_code == 2
    lines = changed.output.strip().splitlines()
    assert len(lines) == 1 and "setting calibration.samples was 4, now 8" in lines[0] and f"rm -rf {killed}" in lines[0], changed.output
    assert _digests(killed) == before and not out.exists()  # refused: the killed run is left as it was


def test_fingerprint_differences_name_the_setting_the_model_file_and_the_calibration():
    model = {"path": "m", "sha256": {"config.json": "a" * 64, "model.safetensors": "b" * 64}}
    tokens = torch.arange(12).reshape(3, 4)
    base = fingerprint({"stages": [{"method": "gptq", "bits": 4}], "output": {"path": "o"}}, model, tokens)
    assert _difference(base, base) is None
    other = fingerprint({"stages": [{"method": "gptq", "bits": 3}], "output": {"path": "o"}}, model, tokens)
    assert _difference(base, other) == "setting stages[0].bits was 4, now 3"
    edited = {**model, "sha256": {**model["sha256"], "model.safetensors": "c" * 64}}
    assert _difference(base, fingerprint({"stages": [{"method": "gptq", "bits": 4}], "output": {"path": "o"}}, edited, tokens)) == (
        "model file model.safetensors changed (SHA-256 bbbbbbbbbbbb → cccccccccccc)")
    swapped = tokens.clone()
    swapped[0, 0] = 99
    message = _difference(base, fingerprint({"stages": [{"method": "gptq", "bits": 4}], "output": {"path": "o"}}, model, swapped))
    assert message.startswith("the calibration tokens changed ((3, 4) sha256 ")


@pytest.mark.parametrize("how", ["--resume", "resume: true"])
def test_a_recipe_resumes_by_flag_or_key(tmp_path, three_blocks, monkeypatch, how):
    out = tmp_path / "out"
    text = (f"model: {three_blocks}\ncalibration: {{path: {CALIB_TEXT}, samples: 4, seq_len: 32}}\n"
            f"stages:\n  - method: sparsegpt\n    sparsity: 0.5\noutput: {{path: {out}}}\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    done = CliRunner().invoke(app, ["run", str(recipe)])
    assert done.exit_code == 0, done.output
    whole = _digests(out)
    shutil.rmtree(out)
    _killed_after(0, ["run", str(recipe)], out, monkeypatch)
    if how == "resume: true":
        recipe.write_text(text + "resume: true\n")
    resumed = CliRunner().invoke(app, ["run", str(recipe), *([how] if how == "--resume" else [])])
    assert resumed.exit_code == 0, resumed.output
    assert _digests(out) == whole


def test_no_record_waits_for_the_model_digests_and_a_kill_before_them_resumes_from_the_start(tmp_path, three_blocks, monkeypatch):
    """While the model's files are still being hashed (here: never done until the run's record takes them), blocks
    are written without a progress record: a kill after block 1 leaves none, --resume says there is nothing to
    continue, and the run started again writes the bytes of an uninterrupted one."""
    from compress.checkpoints.background import Background

    out = tmp_path / "out"
    argv = ["quantize", str(three_blocks), "-o", str(out), "--method", "gptq", "--group-size", "32", *CALIB]
    assert CliRunner().invoke(app, argv).exit_code == 0
    whole = _digests(out)
    shutil.rmtree(out)
    monkeypatch.setattr(Background, "done", lambda self: False)
    killed = _killed_after(1, argv, out, monkeypatch)
    assert not (killed / PROGRESS / "progress.json").exists()
    resumed = CliRunner().invoke(app, [*argv, "--resume"])
    assert resumed.exit_code == 2 and "no interrupted run" in resumed.output and "run without --resume" in resumed.output
    again = CliRunner().invoke(app, argv)
    assert again.exit_code == 0, again.output
    assert _digests(out) == whole
