"""vLLM (its CPU build, a real consumer) scores our float, FP8 and W8A8 outputs as our evaluator does.

`compress eval ppl --backend vllm` against the default backend on SmolLM2's first 2 blocks, 512 held-out tokens
at ctx 256. Float must agree to float32 rounding; FP8 and W8A8 quantize activations at run time, where float32
reductions summed in another order move a few values across a rounding boundary, which the next layers carry on
(docs/evaluate.md, "W8A8: what vLLM computes"): FP8 agrees within 0.5 % (measured 0.03 %), W8A8 within 1 %
(measured 0.47 %; our own W8A8 perplexity moves by up to 4 % when the embeddings change by 1e-6, results.md). Needs the venv
``python bench/anchors/vllm_venv.py`` builds; skipped, with that reason, without it.
"""

from __future__ import annotations

import json

import pytest

from compress.eval.vllm_backend import DEFAULT_VENV, default_python
from conftest import EVAL_TEXT, truncate_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2]


@pytest.fixture(scope="module")
def vllm_python():
    python = default_python()
    if python is None:
        pytest.skip(f"no vLLM venv at {DEFAULT_VENV}: python bench/anchors/vllm_venv.py builds it")
    return python


@pytest.fixture(scope="module")
def smollm2_2_blocks(smollm2, tmp_path_factory):
    return truncate_checkpoint(smollm2, tmp_path_factory.mktemp("smollm2") / "2-blocks", 2)


def _cli(*args: str) -> str:
    from typer.testing import CliRunner

    from compress.cli.app import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _ppl(model, *backend: str) -> float:
    out = _cli("eval", "ppl", str(model), "--text", str(EVAL_TEXT), "--ctx", "256", "--max-tokens", "512", "--json", *backend)
    return json.loads(out)["perplexity"]


@pytest.mark.parametrize("scheme, tolerance", [(None, 1e-5), ("fp8-dynamic", 0.005), ("w8a8-int8", 0.01)])
def test_vllm_perplexity_agrees_with_ours(vllm_python, smollm2_2_blocks, tmp_path, scheme, tolerance):
    model = smollm2_2_blocks
    if scheme is not None:
        model = tmp_path / scheme
        _cli("quantize", str(smollm2_2_blocks), "-o", str(model), "--scheme", scheme)
    ours = _ppl(model)
    theirs = _ppl(model, "--backend", "vllm", "--vllm-python", str(vllm_python))
    print(f"{scheme or 'float'}: ours {ours:.4f}, vLLM {theirs:.4f}, ratio {theirs / ours:.6f}")
    assert abs(theirs / ours - 1) < tolerance, (ours, theirs)


def test_vllm_cpu_fp8_cache_stores_our_toward_zero_rounding(vllm_python):
    """vLLM's CPU cache (the op its attention fills the cache with) stores E4M3 values rounded toward zero: our
    `FP8Rounding.toward_zero` gives its values exactly, and round-to-nearest does not."""
    import subprocess
    from pathlib import Path

    import torch

    from compress.quantizers.kv_cache import FP8Rounding, KVCacheFormat, quantize_kv

    script = Path(__file__).resolve().parents[2] / "bench" / "vllm_kv_rounding.py"
    run = subprocess.run([str(vllm_python), str(script), "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    values, stored = (torch.tensor(answer[k]).reshape(1, 1, 32, 64) for k in ("values", "stored"))
    one = torch.tensor([1.0])
    torch.testing.assert_close(quantize_kv(values, KVCacheFormat.fp8, one, FP8Rounding.toward_zero), stored, rtol=0, atol=0)
    assert (quantize_kv(values, KVCacheFormat.fp8, one) != stored).float().mean() > 0.3


def test_vllm_cpu_refuses_online_rotations_in_one_line(vllm_python, tmp_path):
    """vLLM's CPU build reads the transform_config of a rotated checkpoint but has no Hadamard kernel to apply it
    (vLLM 0.32: ``HadamardTransform`` has no ``cpu_linear``): one line naming our evaluator as the way to score it."""
    from typer.testing import CliRunner

    from compress.cli.app import app
    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe
    from conftest import REFERENCE_MODEL

    stages = [{"method": "rotate", "kind": "random-hadamard", "online": ["r4"]}]
    rotated = run_recipe(parse_recipe({"model": REFERENCE_MODEL, "stages": stages, "output": {"path": tmp_path / "r4"}})).output
    result = CliRunner().invoke(app, ["eval", "ppl", str(rotated), "--text", str(EVAL_TEXT), "--ctx", "256", "--max-tokens",
                                      "512", "--backend", "vllm", "--vllm-python", str(vllm_python)])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: vLLM could not run") and "score it with --backend ours" in line
