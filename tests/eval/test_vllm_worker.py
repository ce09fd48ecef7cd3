"""The vLLM backend's child-process protocol, without vLLM: a stand-in ``vllm`` package answers the worker.

The stand-in computes ``prompt_logprobs`` the way vLLM defines them (row i: ``log P(ids[i] | ids[:i])``, from a
full forward pass of the whole prompt) with transformers, independently of `compress.eval.perplexity`; the
backend's perplexity must then equal our evaluator's on the same windows. Its refusal and its death must come
back as one line naming the checkpoint and the reason.
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from compress.errors import CompressError
from compress.eval.perplexity import evaluate, sliding_windows
from compress.eval.vllm_backend import (
    VllmRefused, VllmSettings, _reason_from_log, evaluate_vllm, kv_cache_dtype_for, resolve_python, score_tasks,
)
from references import one_line_error

FAKE_VLLM = '''
import os, types
__version__ = "stand-in"

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class _Logprob:
    def __init__(self, value):
        self.logprob = value

class LLM:
    def __init__(self, model, **kw):
        if os.environ.get("FAKE_VLLM_KILL"):
            os.kill(os.getpid(), 9)
        if os.environ.get("FAKE_VLLM_REFUSE"):
            raise ValueError(os.environ["FAKE_VLLM_REFUSE"] + "\\nsecond line of the traceback text")
        import torch
        from transformers import AutoModelForCausalLM

        self.kw = kw
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32, quantization=None))

    def generate(self, prompts, params, use_tqdm=False):
        import torch

        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt["prompt_token_ids"]])
            with torch.no_grad():
                lp = self.model(input_ids=ids).logits[0].double().log_softmax(-1)
            rows = [None] + [{int(ids[0, i]): _Logprob(float(lp[i - 1, ids[0, i]]))} for i in range(1, ids.shape[1])]
            new = types.SimpleNamespace(token_ids=[int(lp[-1].argmax())] * params.max_tokens)
            outputs.append(types.SimpleNamespace(prompt_logprobs=rows, outputs=[new]))
        return outputs
'''


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory) -> Path:
    """An interpreter whose ``import vllm`` finds the stand-in."""
    root = tmp_path_factory.mktemp("fake-vllm")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (root / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    python = root / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{root}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def test_score_tasks_send_each_window_and_its_first_scored_position():
    tokens = torch.arange(100, 140)
    task, n = score_tasks(tokens, ctx=16, stride=None)
    windows = sliding_windows(40, 16, 16)
    assert n == len(windows) == len(task["prompts"])
    scored = [p[k:] for p, k in zip(task["prompts"], task["score_from"])]
    assert sum(scored, []) == list(range(101, 140))  # every token after the first, exactly once
    assert all(len(p) <= 16 for p in task["prompts"])


def test_perplexity_through_the_worker_equals_ours(fake_python, tiny_llama):
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(0))
    for ctx, stride in ((32, None), (48, 16)):
        ours = evaluate(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), tokens, ctx=ctx, stride=stride)
        theirs = evaluate_vllm(tiny_llama, tokens, ctx, stride, VllmSettings(python=fake_python, timeout=300))
        assert theirs.tokens_scored == ours.tokens_scored == 149 and theirs.windows == ours.windows
        assert abs(theirs.perplexity / ours.perplexity - 1) < 1e-5, (theirs.perplexity, ours.perplexity)
        assert theirs.kld is None


def test_a_refusal_is_one_line_naming_the_checkpoint_and_vllms_reason(fake_python, tiny_llama, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_REFUSE", "Unsupported quantization scheme for CPU")
    msg = one_line_error(evaluate_vllm, tiny_llama, torch.arange(20), 8, None, VllmSettings(python=fake_python, timeout=300))
    assert msg == f"vLLM could not run {tiny_llama}: ValueError: Unsupported quantization scheme for CPU"


def test_a_killed_worker_is_one_line_with_the_signal(fake_python, tiny_llama, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_KILL", "1")
    with pytest.raises(VllmRefused) as err:
        evaluate_vllm(tiny_llama, torch.arange(20), 8, None, VllmSettings(python=fake_python, timeout=300))
    assert "\n" not in str(err.value) and "SIGKILL" in err.value.reason and str(tiny_llama) in str(err.value)


def test_the_last_exception_line_of_a_dead_worker_is_its_reason():
    log = "INFO loading\nTraceback (most recent call last):\n  File x\nRuntimeError: oneDNN has no kernel for this\n\n"
    assert _reason_from_log(log, 1) == "RuntimeError: oneDNN has no kernel for this"
    assert _reason_from_log("", 3) == "exit status 3"


def test_a_missing_interpreter_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setattr("compress.eval.vllm_backend.DEFAULT_VENV", tmp_path / "absent")
    assert "bench/anchors/vllm_venv.py" in one_line_error(resolve_python, None)
    assert "does not exist" in one_line_error(resolve_python, tmp_path / "nope" / "python")


def test_kv_cache_dtype_follows_the_checkpoints_scheme(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 8}}}))
    assert kv_cache_dtype_for(tmp_path, None) == "fp8" and kv_cache_dtype_for(tmp_path, "none") == "auto"
    (tmp_path / "config.json").write_text("{}")
    assert kv_cache_dtype_for(tmp_path, None) == "auto" and kv_cache_dtype_for(tmp_path, "fp8") == "fp8"
    assert "fp8 KV cache only" in one_line_error(kv_cache_dtype_for, tmp_path, "int8")


def test_the_cli_refuses_kld_options_with_the_vllm_backend(tiny_llama):
    from typer.testing import CliRunner

    from compress.cli.app import app
    from conftest import EVAL_TEXT

    result = CliRunner().invoke(app, ["eval", "ppl", str(tiny_llama), "--text", str(EVAL_TEXT), "--backend", "vllm", "--reference", str(tiny_llama)])
    assert result.exit_code == 2 and "perplexity only" in result.output
    result = CliRunner().invoke(app, ["eval", "ppl", str(tiny_llama), "--text", str(EVAL_TEXT), "--backend", "vlm"])
    assert result.exit_code == 2 and "choose ours or vllm" in result.output


def test_the_workers_one_line_keeps_the_reasons_a_refusal_announces():
    import importlib.util

    from compress.eval import vllm_backend

    spec = importlib.util.spec_from_file_location("vllm_worker", vllm_backend.WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # imports nothing of vLLM's at module level
    err = ValueError("Failed to find a kernel that can implement the WNA16 linear layer. Reasons:\n"
                     " CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not supported\n")
    assert worker.one_line(err) == ("ValueError: Failed to find a kernel that can implement the WNA16 linear layer. "
                                    "Reasons: CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not supported")
    assert worker.one_line(RuntimeError("boom\nsecond line")) == "RuntimeError: boom"
