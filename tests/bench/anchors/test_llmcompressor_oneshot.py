"""bench/anchors/llmcompressor_oneshot.py's in-venv scorer against our evaluator (compress.eval.perplexity), the
reference: on llm-compressor's own GPTQ w4 g64 output, which both read (the scorer on the model llm-compressor
leaves in memory, ours on the checkpoint it writes), the figures agree to 1e-6 relative; and llm-compressor's QuIP
W4A4 recipe runs and writes what it claims. SmolLM2's first 2 blocks, 4 calibration windows of 128 tokens, 512
held-out tokens at ctx 256. Needs llm-compressor 0.14's venv (bench/pipeline.py builds it at
``~/.cache/llm-compress/llmcompressor-0.14``); skipped, with that reason, without it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from compress.checkpoints.calibration import load_calibration
from compress.checkpoints.loading import load_tokenizer, read_eval_text
from compress.eval.checkpoint import evaluate_checkpoint, token_ids
from conftest import CALIB_TEXT, EVAL_TEXT, REPO

pytestmark = pytest.mark.smollm2

VENV_PYTHON = Path.home() / ".cache" / "llm-compress" / "llmcompressor-0.14" / "bin" / "python"
ONESHOT = REPO / "bench" / "anchors" / "llmcompressor_oneshot.py"
CTX, MAX_TOKENS = 256, 512


@pytest.fixture(scope="module")
def inputs(smollm2_2, tmp_path_factory):
    if not VENV_PYTHON.exists():
        pytest.skip(f"no llm-compressor venv at {VENV_PYTHON.parents[1]}: python bench/pipeline.py --anchor llm-compressor builds it")
    folder = tmp_path_factory.mktemp("llmcompressor")
    tokenizer = load_tokenizer(smollm2_2)
    windows, tokens = folder / "windows.json", folder / "tokens.json"
    windows.write_text(json.dumps(load_calibration(CALIB_TEXT, tokenizer, 4, 128).tolist()))
    tokens.write_text(json.dumps(token_ids(tokenizer, read_eval_text(EVAL_TEXT), MAX_TOKENS).tolist()))
    return smollm2_2, windows, tokens


def _oneshot(inputs, method: str, out: Path) -> dict:
    model, windows, tokens = inputs
    run = subprocess.run([str(VENV_PYTHON), str(ONESHOT), str(model), str(out), str(windows), method, "4", "64", "1", "cpu",
                          str(tokens), str(CTX)], capture_output=True, text=True, cwd="/", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "score.json").read_text())


def test_in_venv_scorer_equals_our_evaluator(inputs, tmp_path):
    theirs = _oneshot(inputs, "gptq", tmp_path / "w4a16")
    ours = evaluate_checkpoint(tmp_path / "w4a16", EVAL_TEXT, CTX, None, 8, inputs[0], "cpu", MAX_TOKENS)
    assert theirs["tokens_scored"] == ours.tokens_scored == MAX_TOKENS - 1
    assert ours.kld > 1e-3  # a quantized model, not the float one
    for key, value in (("kld", ours.kld), ("kld_p99", ours.kld_p99), ("perplexity", ours.perplexity),
                       ("ref_perplexity", ours.ref_perplexity)):
        assert theirs[key] == pytest.approx(value, rel=1e-6), key


def test_quip_w4a4_recipe(inputs, tmp_path):
    figures = _oneshot(inputs, "quip-w4a4:block=64", tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    w = group["weights"]
    assert (w["num_bits"], w["symmetric"], w["strategy"], w["group_size"], w["actorder"]) == (4, True, "group", 64, "static")
    assert (group["input_activations"]["num_bits"], group["input_activations"]["strategy"],
            group["input_activations"]["dynamic"]) == (4, "token", True)
    assert qc["ignore"] == ["lm_head"]
    v = qc["transform_config"]["config_groups"]["v"]
    assert (v["type"], v["head_dim"], [a["location"] for a in v["apply"]]) == ("random-hadamard", 64, ["input", "weight_input"])
    assert 0 < figures["kld"] < 5 and figures["tokens_scored"] == MAX_TOKENS - 1
