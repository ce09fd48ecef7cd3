"""Measure -> allocate -> apply: resumable measurements, plans as recipes, one config group per scheme that
transformers loads, and budgets that cannot be met as one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from compress.checkpoints.calibration import CalibrationSpec
from compress.engine.sensitivity import Solver, SolverSettings
from compress.errors import CompressError
from compress.run.measure import run_measure
from compress.run.plan import PlanSpec, allocate, load_sensitivity, save_plan, uniform_plan
from compress.run.recipe import load_recipe, parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT

RTN = SolverSettings(Solver.rtn)


@pytest.fixture
def sensitivity(tiny_llama, tmp_path):
    spec = CalibrationSpec(path=CALIB_TEXT, samples=4, seq_len=32)
    result = run_measure(tiny_llama, spec, "w2g32,w4g32,w8", tmp_path / "s.json", settings=RTN)
    return result.sensitivity


def test_rerun_measures_only_new_candidates_and_keeps_the_old(tiny_llama, tmp_path):
    spec = CalibrationSpec(path=CALIB_TEXT, samples=4, seq_len=32)
    out = tmp_path / "s.json"
    first = run_measure(tiny_llama, spec, "w4g32", out, settings=RTN)
    assert first.measured == ["w4g32"] and first.reused == []
    before = json.loads(out.read_text())["layers"]
    second = run_measure(tiny_llama, spec, "w2g32,w4g32", out, settings=RTN)
    assert second.measured == ["w2g32"] and second.reused == ["w4g32"]
    after = json.loads(out.read_text())["layers"]
    assert all(after[n]["candidates"]["w4g32"] == before[n]["candidates"]["w4g32"] for n in before)
    assert all("w2g32" in after[n]["candidates"] for n in after)
    third = run_measure(tiny_llama, spec, "w2g32", out, settings=RTN)
    assert third.measured == [] and third.reused == ["w2g32"]
    other = CalibrationSpec(path=CALIB_TEXT, samples=5, seq_len=32)
    with pytest.raises(CompressError, match="another calibration") as info:
        run_measure(tiny_llama, other, "w8", out, settings=RTN)
    assert "\n" not in str(info.value)


def test_allocation_is_between_the_uniform_plans(sensitivity):
    low, high = uniform_plan(sensitivity, "w2g32"), uniform_plan(sensitivity, "w4g32")
    plan = allocate(sensitivity, target_bytes=(low.bytes + high.bytes) // 2)
    assert low.bytes < plan.bytes <= (low.bytes + high.bytes) // 2
    assert high.predicted_kld < plan.predicted_kld < low.predicted_kld
    assert plan.predicted_kld == pytest.approx(sum(plan.costs.values()))
    ceiling = allocate(sensitivity, max_kld=plan.predicted_kld)
    assert ceiling.bytes <= plan.bytes and ceiling.predicted_kld <= plan.predicted_kld * (1 + 1e-9)


def test_budget_below_the_smallest_candidate_is_one_line(sensitivity, tmp_path, tiny_llama):
    with pytest.raises(CompressError) as info:
        allocate(sensitivity, target_bpw=1.0)
    assert "smallest plan" in str(info.value) and "\n" not in str(info.value)
    from typer.testing import CliRunner

    from compress.cli import app

    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "-o", str(out), "--plan", str(sensitivity.path), "--target-bpw", "1"])
    assert result.exit_code == 2 and not out.exists()
    message = result.output.strip()
    assert "smallest plan" in message and "Traceback" not in message


def test_plan_round_trips_through_recipes_into_one_config_group_per_scheme(sensitivity, tmp_path, tiny_llama):
    plan = allocate(sensitivity, target_bpw=4.5)
    assert len(set(plan.layers.values())) > 1  # a mixed plan
    save_plan(tmp_path / "plan.json", plan)

    def run(name: str, plan_yaml: str, fmt: str = "compressed-tensors"):
        text = f"model: {tiny_llama}\nstages:\n  - method: rtn\n    plan: {plan_yaml}\noutput: {{path: {tmp_path / name}, format: {fmt}}}\n"
        (tmp_path / f"{name}.yaml").write_text(text)
        return run_recipe(load_recipe(tmp_path / f"{name}.yaml"))

    from_file = run("file", str(tmp_path / "plan.json"))
    inline = "\n      layers:\n" + "".join(f"        {layer}: {c}\n" for layer, c in plan.layers.items())
    from_inline = run("inline", inline)
    run("fake", str(tmp_path / "plan.json"), "fake")
    assert from_file.plans[0]["layers"] == plan.layers == from_inline.plans[0]["layers"]
    a, b = load_file(tmp_path / "file" / "model.safetensors"), load_file(tmp_path / "inline" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    config = json.loads((tmp_path / "file" / "config.json").read_text())
    assert config["compression"]["stages"][0]["plan"]["layers"] == plan.layers
    groups = config["quantization_config"]["config_groups"].values()
    by_scheme = {}
    for g in groups:
        w = g["weights"]
        key = f"w{w['num_bits']}" + (f"g{w['group_size']}" if w["strategy"] == "group" else "")
        by_scheme[key] = sorted(g["targets"])
    expected = {}
    for layer, c in plan.layers.items():
        expected.setdefault(c, []).append(layer)
    assert by_scheme == {c: sorted(v) for c, v in expected.items()}

    fake_weights = load_file(tmp_path / "fake" / "model.safetensors")
    for layer, c in plan.layers.items():  # each layer on its own grid: at most 2^bits values per group
        bits, group = (int(x) for x in c[1:].split("g")) if "g" in c else (int(c[1:]), 64)
        groups = fake_weights[f"{layer}.weight"].reshape(-1, group)
        assert max(len(torch.unique(row)) for row in groups) <= 2**bits

    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, 200, (1, 16))
    with torch.no_grad():
        consumer = AutoModelForCausalLM.from_pretrained(tmp_path / "file", dtype=torch.float32).eval()(x).logits
        fake = AutoModelForCausalLM.from_pretrained(tmp_path / "fake", dtype=torch.float32).eval()(x).logits
    assert (consumer - fake).abs().max() <= 1e-5


def test_regex_keys_and_the_stage_settings_fill_an_inline_plan(tmp_path, tiny_llama):
    recipe = parse_recipe({
        "model": tiny_llama, "output": {"path": tmp_path / "o", "format": "fake"},
        "stages": [{"method": "rtn", "bits": 8, "group_size": -1, "plan": {"layers": {"re:mlp\\.down_proj": "w2g32"}}}],
    })
    result = run_recipe(recipe)
    assert set(result.plans[0]["layers"]) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    record = json.loads((tmp_path / "o" / "config.json").read_text())["compression"]["stages"][0]
    assert record["bits"] == 8 and record["plan"]["layers"]["model.layers.1.mlp.down_proj"] == "w2g32"


@pytest.mark.parametrize("stage, needle", [
    ({"method": "awq", "plan": {"layers": {"x": "w4g32"}}}, "cannot take a per-layer plan"),
    ({"method": "rtn", "plan": {"layers": {"model.layers.0.mlp.up_proj": "w4g32"}}, "include": ["down_proj"]}, "does not select"),
    ({"method": "rtn", "plan": {"layers": {"model.layers.0.mlp.up_proj": "q4_k"}}}, "GGUF plans"),
    ({"method": "rtn", "plan": {"layers": {"model.layers.0.mlp.up_proj": "w4g48"}}}, "does not fit"),
    ({"method": "rtn", "plan": {"layers": {"a": "w4"}, "target_bpw": 3}}, "takes no target"),
])
def test_bad_plans_are_one_line_errors_before_any_output(stage, needle, tmp_path, tiny_llama):
    with pytest.raises(CompressError) as info:
        run_recipe(parse_recipe({"model": tiny_llama, "stages": [stage], "output": {"path": tmp_path / "o"}}))
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "o").exists()


def test_sensitivity_file_needs_a_target(sensitivity, tmp_path):
    from compress.run.plan import resolve_plan

    with pytest.raises(CompressError, match="add a target"):
        resolve_plan(PlanSpec(path=sensitivity.path), list(sensitivity.layers))


def test_a_hand_edited_plan_is_predicted_from_its_measurements(sensitivity, tmp_path):
    from compress.run.plan import resolve_plan

    plan = allocate(sensitivity, target_bpw=4.5)
    save_plan(tmp_path / "plan.json", plan)
    data = json.loads((tmp_path / "plan.json").read_text())
    layer = next(iter(data["layers"]))
    data["layers"][layer] = "w2g32"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    edited = resolve_plan(PlanSpec(path=tmp_path / "plan.json"), list(sensitivity.layers))
    costs = sensitivity.costs()
    assert edited.layers[layer] == "w2g32"
    assert edited.predicted_kld == pytest.approx(sum(costs[n][c] for n, c in edited.layers.items()))
    assert edited.bytes == sum(sensitivity.layers[n]["candidates"][c]["bytes"] for n, c in edited.layers.items())
