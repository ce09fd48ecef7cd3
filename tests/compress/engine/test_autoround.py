"""AutoRound through the engine and the CLI on the tiny random Llama: no steps is RTN to the bit; a few steps write a
compressed-tensors checkpoint that transformers loads, closer to the float model (KLD on held-out text) than RTN's."""

from __future__ import annotations

import hashlib
import json
import shutil

import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from compress.cli import app
from compress.engine.journal import BlockJournal
from conftest import CALIB_TEXT, EVAL_TEXT, checkpoint_tensors

runner = CliRunner()
CALIB = ["--calib", CALIB_TEXT, "--samples", "8", "--seq-len", "64"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_no_steps_writes_rtn(tmp_path, tiny_llama):
    grid = ["--bits", "3", "--group-size", "32", "--asym"]
    assert invoke("quantize", tiny_llama, "-o", tmp_path / "rtn", *grid).exit_code == 0
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "ar", *grid, "--method", "autoround", "-O", "iters=0", *CALIB)
    assert result.exit_code == 0, result.output
    rtn, ar = checkpoint_tensors(tmp_path / "rtn"), checkpoint_tensors(tmp_path / "ar")
    assert rtn.keys() == ar.keys()
    assert all(torch.equal(rtn[k], ar[k]) for k in rtn)


def test_few_steps_beat_rtn_and_load(tmp_path, tiny_llama):
    text = tmp_path / "eval.txt"
    text.write_text(EVAL_TEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    grid = ["--bits", "3", "--group-size", "32", "--eval-text", text, "--json"]
    rtn = invoke("quantize", tiny_llama, "-o", tmp_path / "rtn", *grid)
    out = tmp_path / "ar"
    ar = invoke("quantize", tiny_llama, "-o", out, *grid, "--method", "autoround", "-O", "iters=20", "-O", "batch_size=4", *CALIB)
    assert rtn.exit_code == 0 and ar.exit_code == 0, ar.output
    kld_rtn, kld_ar = (json.loads(r.stdout)["evaluation"]["kld"] for r in (rtn, ar))
    assert kld_ar <= kld_rtn, f"autoround KLD {kld_ar:.5f} vs RTN {kld_rtn:.5f}"
    config = json.loads((out / "config.json").read_text())
    assert config["compression"]["stages"][0]["method"] == "autoround"
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 3
    rows = json.loads((out / "compression_report.json").read_text())["layers"]
    assert len(rows) == 14 and all(r["info"]["loss_best"] <= r["info"]["loss_first"] for r in rows)
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # compressed-tensors decodes the packed codes
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 100, (1, 16))).logits).all()


def test_float_inputs_and_last_step(tmp_path, tiny_llama):
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "--bits", "4", "--group-size", "32", "--method", "autoround",
                    "-O", "iters=3", "-O", "enable_quanted_input=false", "-O", "not_use_best_mse=true", *CALIB)
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "o" / "compression_report.json").read_text())["layers"]
    assert all(r["info"]["best_step"] == 2 for r in rows)


def test_outside_blocks_is_a_clear_error(tmp_path, tiny_llama):
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "--method", "autoround", "--group-size", "32",
                    "--include", "lm_head", *CALIB)
    assert result.exit_code == 2
    assert "exclude lm_head" in result.stderr


def test_without_calibration_is_a_clear_error(tmp_path, tiny_llama):
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "--method", "autoround", "--group-size", "32")
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: method autoround needs calibration data: pass --calib PATH"


def test_a_resumed_run_writes_the_same_bytes(tmp_path, tiny_llama, monkeypatch):
    """Killed after block 0's record (simulated as tests/compress/engine/test_journal.py does) and resumed: the journal
    restores the uncompressed model's stream, and the steps' sample order is seeded, so the output is the same."""
    out, killed = tmp_path / "out", tmp_path / ".out.partial-999999"
    argv = ["quantize", tiny_llama, "-o", out, "--bits", "3", "--group-size", "32", "--method", "autoround", "-O", "iters=4", *CALIB]
    assert invoke(*argv).exit_code == 0
    digests = lambda: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*")) if p.is_file()}  # noqa: E731
    whole = digests()
    shutil.rmtree(out)
    record = BlockJournal.block_done

    def done(self, index, *args):
        record(self, index, *args)
        if index == 0:
            shutil.copytree(self.root.parent, killed)

    with monkeypatch.context() as patch:
        patch.setattr(BlockJournal, "block_done", done)
        assert invoke(*argv).exit_code == 0
    shutil.rmtree(out)
    resumed = invoke(*argv, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert digests() == whole
    assert not killed.exists()  # the killed run's directory became the output: the run went on from it


def test_gptq_start_without_steps_writes_gptq(tmp_path, tiny_llama):
    """``init=gptq`` with no steps is act-order GPTQ on min-max static groups, the Hessians of one pass per block, on
    the same (full-range) grid."""
    grid = ["--bits", "3", "--group-size", "32", *CALIB]
    gptq = invoke("quantize", tiny_llama, "-o", tmp_path / "gptq", *grid, "--method", "gptq", "-O", "act_order=true",
                  "-O", "mse=false", "-O", "true_sequential=false", "-O", "full_range=true", "-O", "refit_scales=false")
    ar = invoke("quantize", tiny_llama, "-o", tmp_path / "ar", *grid, "--method", "autoround", "-O", "init=gptq",
                "-O", "iters=0")
    assert gptq.exit_code == 0 and ar.exit_code == 0, ar.output
    want, got = checkpoint_tensors(tmp_path / "gptq"), checkpoint_tensors(tmp_path / "ar")
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    few = invoke("quantize", tiny_llama, "-o", tmp_path / "few", *grid, "--method", "autoround", "-O", "init=gptq",
                 "-O", "iters=3")
    assert few.exit_code == 0, few.output
    rows = json.loads((tmp_path / "few" / "compression_report.json").read_text())["layers"]
    assert all(r["info"]["loss_best"] <= r["info"]["loss_first"] for r in rows)
