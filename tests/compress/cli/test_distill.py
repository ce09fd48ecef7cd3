"""`compress distill` and recipes with a distill section: parsing, errors, end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import CALIB_TEXT, REPO
from typer.testing import CliRunner

from compress.cli import app
from compress.cli.distill import parse_student
from compress.errors import CompressError
from compress.run.recipe import load_recipe, parse_recipe

runner = CliRunner()


def test_parse_student(tmp_path):
    assert parse_student("layers:0,2") == {"layers": [0, 2]}
    assert parse_student("every:2") == {"every": 2}
    assert parse_student("config:hidden_size=128,intermediate_size=384") == {"config": {"hidden_size": 128, "intermediate_size": 384}}
    assert parse_student(str(tmp_path)) == {"checkpoint": str(tmp_path)}
    for bad in ("layers:a", "config:hidden_size", "nowhere/at/all"):
        with pytest.raises(CompressError):
            parse_student(bad)


@pytest.mark.parametrize("name", ["distill-half-depth.yaml", "sparsegpt-2of4-then-distill.yaml", "structured-then-distill.yaml"])
def test_shipped_recipes_parse(name):
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.distill is not None and recipe.distill.tau == 2.0


def test_distill_only_recipe_and_errors(tmp_path):
    base = {"model": "m", "output": {"path": "o"}, "distill": {"data": "t.txt", "student": {"every": 2}}}
    assert parse_recipe(base).stages == []
    with pytest.raises(CompressError, match="valid keys are"):
        parse_recipe({**base, "distill": {**base["distill"], "temperature": 2}})
    with pytest.raises(CompressError, match="stages"):
        parse_recipe({"model": "m", "output": {"path": "o"}})
    path = tmp_path / "r.yaml"
    path.write_text("model: m\noutput:\n  path: o\ndistill:\n  data: t.txt\n  alpha: 2\n")
    with pytest.raises(CompressError, match=r"r.yaml:6: distill.alpha"):
        load_recipe(path)


def test_cli_distills_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "out"
    args = ["distill", str(tiny_llama), "-o", str(out), "--student", "layers:1", "--data", str(CALIB_TEXT), "--steps", "2",
            "--batch-size", "2", "--seq-len", "32", "--eval-text", str(CALIB_TEXT), "--eval-max-tokens", "256", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 2 and summary["after"]["perplexity"] > 0 and summary["before"]["kld"] > 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["compression"]["stages"][0]["method"] == "distill"
    assert (out / "tokenizer.json").is_file() and not (out / "training.json").exists()
    again = runner.invoke(app, args)  # exists, no --overwrite
    assert again.exit_code == 2 and "already exists" in again.output


@pytest.mark.parametrize(
    ("student", "needle"),
    [("layers:9", "do not exist"), ("bogus", "neither a checkpoint"), ("config:hidden_sise=8", "hidden_sise")],
)
def test_cli_errors_are_one_line(tiny_llama, tmp_path, student, needle):
    result = runner.invoke(app, ["distill", str(tiny_llama), "-o", str(tmp_path / "o"), "--student", student, "--data", str(CALIB_TEXT)])
    assert result.exit_code == 2
    assert "error:" in result.output and needle in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_recipe_prune_then_distill_keeps_2_of_4(tiny_llama, tmp_path):
    import torch

    from compress.checkpoints.loading import load_model
    from compress.pruners.masks import is_nm_sparse

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tiny_llama}\nstages:\n  - method: magnitude\n    pattern: '2:4'\n"
        f"distill:\n  data: {CALIB_TEXT}\n  steps: 2\n  batch_size: 2\n  seq_len: 32\n  lr: 0.01\n"
        f"output:\n  path: {tmp_path / 'out'}\n"
        f"export:\n  path: {tmp_path / 'out.gguf'}\n  type: f16\n"
    )
    result = runner.invoke(app, ["run", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["masked_layers"] == 14 and summary["compression"] is not None
    from gguf import GGUFReader  # the export is of the distilled checkpoint, still 2:4 after training

    up = next(t for t in GGUFReader(str(tmp_path / "out.gguf")).tensors if t.name == "blk.0.ffn_up.weight")
    assert is_nm_sparse(torch.from_numpy(np.array(up.data, dtype=np.float32)), 2, 4)
    model = load_model(tmp_path / "out", torch.device("cpu"))
    layers = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    assert len(layers) == 14 and all(is_nm_sparse(m.weight, 2, 4) for m in layers)
    assert not any(Path(p).name.startswith(".out") for p in tmp_path.iterdir())  # staging removed
    record = json.loads((tmp_path / "out" / "config.json").read_text())["compression"]
    assert record["stages"][0]["method"] == "distill" and record["history"][0]["stages"][0]["method"] == "magnitude"


def test_run_recipe_dispatches_a_distill_recipe(tiny_llama, tmp_path):
    from compress.run.distill import DistillResult
    from compress.run.runner import run_recipe

    recipe = parse_recipe({"model": str(tiny_llama), "output": {"path": str(tmp_path / "o")},
                           "distill": {"data": str(CALIB_TEXT), "student": {"layers": [0]}, "steps": 1, "batch_size": 1, "seq_len": 16}})
    result = run_recipe(recipe)
    assert isinstance(result, DistillResult) and len(result.history) == 1 and (tmp_path / "o" / "model.safetensors").is_file()


def test_a_recipes_resume_key_resumes_distillation_too(tiny_llama, tmp_path):
    """``resume: true`` at the top of a recipe is distill's --resume: with no step checkpoint to continue from, the
    same one-line error as ``distill --resume``."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_llama}\ndistill: {{student: {{layers: [0]}}, data: {CALIB_TEXT}, steps: 2, seq_len: 32, "
                      f"batch_size: 2}}\noutput: {{path: {tmp_path / 'out'}}}\nresume: true\n")
    done = runner.invoke(app, ["run", str(recipe)])
    assert done.exit_code == 2 and "--resume: no checkpoint in" in done.output and len(done.output.strip().splitlines()) == 1, done.output
