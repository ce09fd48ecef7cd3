"""`compress sweep`: the grid each method can take, resumption without redoing work, and per-point model cards
whose command reproduces the point."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from compress.cli import app
from compress.run.sweep import SweepConfig, plan_points, run_sweep
from conftest import CALIB_TEXT, EVAL_TEXT

runner = CliRunner()


def config(model: Path, out: Path, **kw) -> SweepConfig:
    base = dict(methods=("rtn",), bits=(4, 8), group_sizes=(32,), max_tokens=300, ctx=64)
    base.update(kw)
    return SweepConfig(model, out, EVAL_TEXT, **base)


def test_plan_crosses_only_the_axes_a_method_has(tmp_path):
    cfg = config(Path("m"), tmp_path, methods=("rtn", "gptq", "smoothquant", "magnitude", "wanda"), bits=(1, 3, 4), group_sizes=(64, 128), sparsities=(0.5,))
    plan = plan_points(cfg)
    names = [p.name for p in plan.points]
    assert names == ["rtn-w3g64", "rtn-w3g128", "rtn-w4g64", "rtn-w4g128", "magnitude-s50"]
    reasons = dict(plan.skipped)
    assert "rtn-w1g64" in reasons and "greater than or equal" in reasons["rtn-w1g64"]  # 1 bit: rejected by the config
    assert reasons["gptq-w3g64"] == reasons["wanda-s50"] == "needs calibration data: pass --calib"
    assert [r for p, r in plan.skipped if p == "smoothquant"][-1] == "needs calibration data: pass --calib"  # its one point
    assert [r for p, r in plan.skipped if p == "smoothquant"][0].startswith("bits/group_size/sparsity is not a setting")
    assert reasons["magnitude"].startswith("bits/group_size is not a setting")
    with_calib = plan_points(config(Path("m"), tmp_path, methods=("gptq",), bits=(3,), group_sizes=(-1,), calib=CALIB_TEXT))
    assert [p.name for p in with_calib.points] == ["gptq-w3pc"] and with_calib.points[0].needs_data


def test_sweep_resumes_and_cards_reproduce(tiny_llama, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    cfg = config(tiny_llama, out, methods=("rtn", "magnitude"), sparsities=(0.5,))
    plan, finished, state = run_sweep(cfg)
    assert [p.name for p in finished] == ["rtn-w4g32", "rtn-w8g32", "magnitude-s50"]
    assert all((p / "config.json").is_file() for p in finished)
    saved = json.loads((out / "sweep.json").read_text())
    assert set(saved["points"]) == {"rtn-w4g32", "rtn-w8g32", "magnitude-s50"}
    rows = next(iter(saved["rows"].values()))
    assert rows[str(out / "rtn-w4g32")]["kld"] > rows[str(out / "rtn-w8g32")]["kld"] > 0

    # resumed: nothing is redone (the runner must not be called), and the same rows come back
    import compress.run.runner

    def refuse(*a, **k):
        raise AssertionError("a finished point was run again")

    monkeypatch.setattr(compress.run.runner, "run_recipe", refuse)
    statuses = []
    _, again, state2 = run_sweep(cfg, on_point=lambda p, s: statuses.append(s))
    assert again == finished and statuses == ["kept"] * 3 and state2["rows"] == saved["rows"]
    monkeypatch.undo()

    # the model card names method, settings and figures, and its command rebuilds the same weights
    card = (out / "rtn-w4g32" / "README.md").read_text()
    assert "| 1 | rtn |" in card and "bits=4" in card and "group_size=32" in card and "mean KLD vs original" in card
    assert "weights on disk" in card and "compress report rtn-w4g32" in card
    command = card.split("```")[1].strip()
    args = shlex.split(command)
    assert args[:2] == ["compress", "quantize"]
    args[args.index("-o") + 1] = str(tmp_path / "again")
    result = runner.invoke(app, [a for a in args[1:]])
    assert result.exit_code == 0, result.output
    ours, theirs = (load_file(d / "model.safetensors") for d in (out / "rtn-w4g32", tmp_path / "again"))
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)


def test_sweep_cli_writes_the_report_and_resumes(tiny_llama, tmp_path):
    out = tmp_path / "sweep"
    args = ["sweep", str(tiny_llama), "-o", str(out), "--text", str(EVAL_TEXT), "--methods", "rtn,gptq", "--bits", "4",
            "--group-size", "32", "--ctx", "64", "--max-tokens", "300", "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert [r["name"] for r in report["outputs"]] == ["rtn-w4g32"]
    assert report["skipped"] == [{"point": "gptq-w4g32", "reason": "needs calibration data: pass --calib"}]
    assert {f.name for f in out.iterdir()} >= {"report.html", "report.md", "report.json", "report.png", "sweep.json"}
    second = runner.invoke(app, args)
    assert second.exit_code == 0 and json.loads(second.stdout)["outputs"] == report["outputs"]
    bad = runner.invoke(app, [*args[:-1], "--bits", "four"])
    assert bad.exit_code == 2 and "comma-separated list of ints" in bad.output


@pytest.mark.parametrize("methods", ["nosuch"])
def test_unknown_method_is_a_one_line_error(tmp_path, methods):
    from references import one_line_error

    assert "unknown method" in one_line_error(plan_points, config(Path("m"), tmp_path, methods=(methods,)))
