"""Forward passes in the checkpoint's dtype (`--compute-dtype`): the engine's statistics of a bfloat16 checkpoint
run in bfloat16 are those of transformers' own bfloat16 forward, accumulated in float32 or wider."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compress.checkpoints.loading import ComputeDtype, resolve_compute_dtype
from compress.engine.methods.rtn import RTN, GridQuantConfig
from compress.engine.statistics import Stat
from conftest import checkpoint_tensors, save_random_model, tiny_llama_config
from engine_cases import StatsSpy, reference_hessians, run_engine

VOCAB = 300


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    return save_random_model(tiny_llama_config(VOCAB), tmp_path_factory.mktemp("bf16") / "in", dtype=torch.bfloat16)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_bfloat16_statistics_are_transformers_bfloat16_forward(bf16_llama, tmp_path):
    calibration = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
    model = AutoModelForCausalLM.from_pretrained(bf16_llama, dtype=torch.bfloat16).eval()
    spies = {}
    for dtype in (torch.bfloat16, torch.float32):
        spies[dtype] = StatsSpy()
        run_engine(bf16_llama, tmp_path / str(dtype), spies[dtype], calibration, dtype=dtype)
    expected = reference_hessians(model, list(spies[torch.bfloat16].seen), calibration)
    for name, stats in spies[torch.bfloat16].seen.items():
        hessian = stats[Stat.HESSIAN]
        assert hessian.dtype in (torch.float32, torch.float64)  # accumulated wide, not in bfloat16
        exact = _relative(hessian.double(), expected[name])
        assert exact < 2e-3, (name, exact)
        # the float32 forward's statistics differ from bfloat16's by bfloat16's rounding: the test can tell them apart
        other = spies[torch.float32].seen[name][Stat.HESSIAN]
        assert _relative(other.double(), expected[name]) > 3 * max(exact, 1e-4), name


def test_unquantized_tensors_keep_their_bytes_and_dtype(bf16_llama, tmp_path):
    calibration = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    run_engine(bf16_llama, tmp_path / "out", RTN(GridQuantConfig(bits=4, group_size=32)), calibration, dtype=torch.bfloat16)
    original = load_file(bf16_llama / "model.safetensors")
    written = checkpoint_tensors(tmp_path / "out")
    for name, tensor in original.items():
        assert written[name].dtype == torch.bfloat16, name
        if "proj" not in name:  # embeddings and norms: copied bit for bit
            assert torch.equal(written[name], tensor), name


@pytest.mark.parametrize(
    ("choice", "stored", "native", "expected"),
    [
        (ComputeDtype.auto, torch.float32, True, torch.float32),
        (ComputeDtype.auto, torch.bfloat16, True, torch.bfloat16),
        (ComputeDtype.auto, torch.bfloat16, False, torch.float32),  # AVX2 only: bfloat16 matmuls convert to float32
        (ComputeDtype.auto, torch.float16, True, torch.float32),  # no fast float16 matmul on a CPU
        (ComputeDtype.bfloat16, torch.float32, False, torch.bfloat16),  # asked for: taken as is
        (ComputeDtype.float32, torch.bfloat16, True, torch.float32),
    ],
)
def test_auto_takes_the_checkpoints_dtype_where_the_cpu_multiplies_it(choice, stored, native, expected, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    dtype, why = resolve_compute_dtype(choice, stored, torch.device("cpu"))
    assert dtype == expected
    assert ("no fast matmul" in why) == (choice is ComputeDtype.auto and stored != expected)


@pytest.mark.parametrize(
    "command",
    [
        ["quantize", "--method", "gptq", "--bits", "4", "--group-size", "32"],
        ["quantize", "--method", "awq", "--bits", "4", "--group-size", "32"],
        ["quantize", "--method", "smoothquant"],
        ["prune", "--method", "sparsegpt", "--sparsity", "0.5"],
        ["prune", "--method", "wanda", "--pattern", "2:4"],
    ],
    ids=lambda command: command[2],
)
def test_every_calibrated_method_runs_in_bfloat16_as_well_as_in_float32(command, tiny_tokenizer, tmp_path):
    """A bfloat16 checkpoint compressed with bfloat16 forwards: the run completes, says so, and its KLD (scored in
    float32 by our evaluator) is that of float32 forwards up to bfloat16's noise."""
    from typer.testing import CliRunner

    from compress.cli import app
    from conftest import CALIB_TEXT, EVAL_TEXT

    model = save_random_model(tiny_llama_config(len(tiny_tokenizer)), tmp_path / "in", tiny_tokenizer, dtype=torch.bfloat16)
    text = tmp_path / "eval.txt"
    text.write_text(EVAL_TEXT.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    kld, notes = {}, {}
    for dtype in ("bfloat16", "float32"):
        args = [command[0], model, "-o", tmp_path / dtype, *command[1:], "--calib", CALIB_TEXT, "--samples", "4",
                "--seq-len", "32", "--eval-text", text, "--compute-dtype", dtype, "--json"]
        result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        kld[dtype], notes[dtype] = summary["evaluation"]["kld"], summary["notes"]
    assert any("forward passes in bfloat16 (--compute-dtype)" in note for note in notes["bfloat16"])
    assert kld["bfloat16"] <= 1.5 * kld["float32"] + 1e-4, kld
    # the same tensors written either way: packed codes and scales where the method quantizes, none left dense
    layouts = {dtype: {k: (v.dtype, tuple(v.shape)) for k, v in checkpoint_tensors(tmp_path / dtype).items()} for dtype in kld}
    assert layouts["bfloat16"] == layouts["float32"]
    assert (command[0] == "quantize") == any(name.endswith("weight_scale") for name in layouts["bfloat16"])
