"""RTN and GPTQ on the float grids through the engine: named schemes, calibrated FP8 / NVFP4 input scales,
packed output equal to the fake-quantized model (dense weights + evaluation's activation hooks, an
independent path), and bad input as one-line errors that write nothing."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from compress.checkpoints.loading import load_model
from compress.cli import app
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT

CALIBRATION = {"path": CALIB_TEXT, "samples": 4, "seq_len": 32}


def run(model, out, stage, fmt="compressed-tensors"):
    recipe = {"model": model, "calibration": CALIBRATION, "stages": [stage], "output": {"path": out, "format": fmt}}
    return run_recipe(parse_recipe(recipe)).output


def test_schemes_expand_to_method_settings():
    recipe = {"model": "m", "output": {"path": "o"}, "stages": [
        {"method": "gptq", "scheme": "nvfp4"},
        {"method": "rtn", "scheme": "fp8-block", "block_rows": 64},  # explicit settings win
        {"method": "rtn", "scheme": "w8a8-int8"},
        {"method": "awq", "scheme": "w4a16"},  # integer schemes reach every weight quantizer
    ]}
    gptq, block, w8a8, awq = (m.config for m in parse_recipe(recipe).methods())
    assert (gptq.grid.value, gptq.bits, gptq.group_size, gptq.activations.value) == ("nvfp4", 4, 16, "nvfp4")
    assert (block.grid.value, block.group_size, block.block_rows, block.activations.value) == ("fp8", 128, 64, "fp8-group")
    assert (w8a8.grid.value, w8a8.bits, w8a8.group_size, w8a8.activations.value) == ("int", 8, -1, "int8-token")
    assert (awq.bits, awq.group_size, awq.symmetric) == (4, "auto", True)  # 128 where it divides every layer


STAGES = {
    "fp8-dynamic": {"scheme": "fp8-dynamic"},
    "fp8-static": {"grid": "fp8", "activations": "fp8-tensor"},  # static per-tensor FP8 inputs, calibrated
    "nvfp4": {"scheme": "nvfp4"},  # W4A4: calibrated global input scale, dynamic E4M3 group scales
    "fp8-block": {"scheme": "fp8-block", "group_size": 32, "block_rows": 32, "activations": "fp8-token"},  # width 64
}


@pytest.mark.parametrize("method,name", [("rtn", name) for name in STAGES] + [("gptq", "nvfp4"), ("awq", "nvfp4"), ("awq", "fp8-static")])
def test_packed_float_output_equals_the_fake_quantized_model(method, name, tmp_path, tiny_llama):
    stage = STAGES[name]
    packed = run(tiny_llama, tmp_path / "ct", {"method": method, **stage})
    fake = run(tiny_llama, tmp_path / "fake", {"method": method, **stage}, fmt="fake")
    record = json.loads((packed / "config.json").read_text())["compression"]["stages"][0]
    acts = record["activations"]
    assert acts["type"] == "float" and len(record["activation_layers"]) == 14
    static = list(record["activation_layers"].values())
    assert all(v is None for v in static) == acts["dynamic"]
    from safetensors.torch import load_file

    stored = load_file(str(packed / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj."
    if stage.get("scheme") == "nvfp4":
        assert stored[key + "weight_packed"].dtype == torch.uint8 and stored[key + "weight_scale"].dtype == torch.float8_e4m3fn
        assert stored[key + "input_global_scale"].shape == (1,)
    else:
        assert stored[key + "weight"].dtype == torch.float8_e4m3fn
        assert (key + "input_scale" in stored) == (not acts["dynamic"])
    x = torch.randint(0, 200, (2, 16))
    ours, reference = load_model(packed, torch.device("cpu")), load_model(fake, torch.device("cpu"))
    assert sum(getattr(m, "quantizes_input", False) for m in ours.modules()) == 14
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, reference(x).logits, rtol=0, atol=1e-5)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("args,needle", [
    (["--scheme", "nvfp4", "--group-size", "32"], "group size must be 16"),
    (["--scheme", "mxfp4a16", "--group-size", "16"], "group size must be 32"),
    (["-O", "grid=nvfp4", "-O", "group_size=64"], "group size must be 16"),
    (["--scheme", "nvfp4", "--method", "smoothquant"], "needs method rtn, gptq or awq"),
    (["--scheme", "fp8-block", "--method", "awq", "-O", "group_size=32", "-O", "block_rows=32"], "set clip false"),
    (["--scheme", "fp8-dynamic", "--bits", "4"], "8 bits"),
    (["-O", "activations=fp8-token"], "set grid fp8"),
    (["--scheme", "fp8-block"], "does not divide in_features 64"),  # tiny model: 128-wide blocks do not fit
    (["--scheme", "fp9"], "scheme"),
    (["--scheme", "nvfp4", "-O", "full_range=true"], "full_range is an integer grid's"),
    (["--asym", "-O", "full_range=true"], "full_range is a symmetric grid"),
    (["--asym", "--method", "autoround", "-O", "full_range=true", "--calib", CALIB_TEXT], "full_range is a symmetric grid"),
])
def test_bad_float_settings_are_one_line_errors_and_write_nothing(args, needle, tmp_path, tiny_llama):
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.output
    assert not (tmp_path / "o").exists()


def test_fp8_without_float8_dtypes_is_a_one_line_error(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    result = invoke("quantize", tiny_llama, "-o", tmp_path / "o", "--scheme", "fp8-dynamic")
    assert result.exit_code == 2 and "float8_e4m3fn" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_awq_static_input_scales_cover_the_scaled_inputs(tmp_path, tiny_llama):
    """AWQ divides a layer's input channels by its scales (folded into the norm before it): NVFP4's static global
    input scale (448 · 6 / max |x|) must cover the inputs the output model really sees. Measured by hooks on the output model run on the
    same calibration windows: q_proj of block 0, whose input depends on no quantized layer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.checkpoints.calibration import load_calibration

    stage = {"method": "awq", **STAGES["nvfp4"]}
    fake = run(tiny_llama, tmp_path / "fake", stage, fmt="fake")
    stored = load_file(str(run(tiny_llama, tmp_path / "ct", stage) / "model.safetensors"))
    windows = load_calibration(CALIB_TEXT, AutoTokenizer.from_pretrained(tiny_llama), CALIBRATION["samples"], CALIBRATION["seq_len"])
    name, seen = "model.layers.0.self_attn.q_proj", []
    for path in (fake, tiny_llama):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.get_submodule(name).register_forward_pre_hook(lambda _m, args: seen.append(args[0].abs().max().item()))
        with torch.no_grad():
            model(input_ids=windows, use_cache=False)
    scaled, original = seen
    assert abs(scaled / original - 1) > 1e-3  # AWQ did rescale this layer's inputs (0.6 % here)
    assert stored[name + ".input_global_scale"].item() == pytest.approx(448.0 * 6.0 / scaled, rel=1e-5)
