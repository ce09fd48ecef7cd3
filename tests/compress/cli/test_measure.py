"""`compress measure` and `compress allocate` end to end, and the plan printed by `compress quantize --plan`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from compress.cli import app
from conftest import CALIB_TEXT

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_measure_allocate_quantize(tiny_llama, tmp_path):
    sens = tmp_path / "s.json"
    common = ["--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "32", "--method", "rtn", "-o", sens]
    first = invoke("measure", tiny_llama, "--candidates", "w2g32,w8", *common, "--json")
    assert first.exit_code == 0, first.output
    assert json.loads(first.output)["measured"] == ["w2g32", "w8"]
    again = invoke("measure", tiny_llama, "--candidates", "w4g32,w8", *common)
    assert again.exit_code == 0 and "w4g32" in again.output and "reused from the file" in again.output

    plan_file = tmp_path / "plan.json"
    allocated = invoke("allocate", sens, "--target-bpw", "4.5", "-o", plan_file)
    assert allocated.exit_code == 0, allocated.output
    assert "predicted KLD" in allocated.output and "down" in allocated.output  # the per-block table
    plan = json.loads(plan_file.read_text())
    assert 4.0 < plan["bits_per_weight"] <= 4.5 and len(plan["layers"]) == 14

    out = tmp_path / "q"
    quantized = invoke("quantize", tiny_llama, "-o", out, "--plan", plan_file, "--json")
    assert quantized.exit_code == 0, quantized.output
    assert json.loads(quantized.output)["plans"][0]["layers"] == plan["layers"]

    ceiling = invoke("allocate", sens, "--max-kld", "1e-12")
    assert ceiling.exit_code == 2 and "below the lowest predicted cost" in ceiling.output
    both = invoke("allocate", sens, "--max-kld", "1", "--target-bpw", "4")
    assert both.exit_code == 2 and "exactly one" in both.output
    no_plan = invoke("quantize", tiny_llama, "-o", tmp_path / "x", "--target-bpw", "3")
    assert no_plan.exit_code == 2 and "--plan" in no_plan.output and not (tmp_path / "x").exists()
