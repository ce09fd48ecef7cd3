"""The vLLM side of `compress.eval.vllm_backend`: a script run by vLLM's own Python, importing nothing of ours.

    VLLM_PYTHON vllm_worker.py REQUEST.json RESULT.json

``REQUEST.json``::

    {"model": DIR, "dtype": "float32", "max_model_len": 513, "kv_cache_dtype": "auto", "seed": 0,
     "tasks": [{"kind": "score", "prompts": [[ids...], ...], "score_from": [k, ...]},
               {"kind": "generate", "prompts": [[ids...], ...], "max_tokens": 16, "ignore_eos": false}]}

Each ``score`` task feeds every prompt (token ids, no BOS added: a ``TokensPrompt``) to ``LLM.generate`` with
``SamplingParams(max_tokens=1, prompt_logprobs=0)`` and returns, per prompt, the log-probability vLLM gives
each prompt token ``i >= score_from`` given the tokens before it (``prompt_logprobs[i][ids[i]]``). Each
``generate`` task decodes greedily and returns the new token ids and the wall time of the batch.

``RESULT.json``: ``{"ok": true, "vllm": VERSION, "device": ..., "load_seconds": s, "results": [...]}``, one
result per task (``{"log_probs": [[...], ...]}`` or ``{"token_ids": [[...], ...], "seconds": s}``), or
``{"ok": false, "error": "ExceptionType: first line"}`` when vLLM refused. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so vLLM's own exception is the one reported.
"""

from __future__ import annotations

import json
import os
import sys
import time

ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: its exception is the one reported
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on CPU: windows of a few hundred tokens
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # a window of ctx tokens needs max_model_len ctx + 1 (vLLM makes room for one generated token): a model whose
    # positions end at ctx still scores it, the extra position only ever holding that unscored token
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
}


def _score(llm, task: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in task["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    log_probs = []
    for ids, first, out in zip(task["prompts"], task["score_from"], outputs):
        rows = out.prompt_logprobs  # [None, {token: Logprob}, ...]: row i is P(ids[i] | ids[:i])
        log_probs.append([float(rows[i][ids[i]].logprob) for i in range(first, len(ids))])
    return {"log_probs": log_probs}


def _generate(llm, task: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=task["max_tokens"], temperature=0.0, ignore_eos=bool(task.get("ignore_eos")))
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in task["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds}


def run(request: dict) -> dict:
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=request["model"], dtype=request.get("dtype", "float32"), max_model_len=request["max_model_len"],
        kv_cache_dtype=request.get("kv_cache_dtype", "auto"), seed=request.get("seed", 0), enable_prefix_caching=False,
        max_num_seqs=request.get("max_num_seqs", 64), enforce_eager=request.get("enforce_eager", True),
    )
    load_seconds = time.perf_counter() - start
    results = [(_score if task["kind"] == "score" else _generate)(llm, task) for task in request["tasks"]]
    config = llm.llm_engine.model_config
    return {"ok": True, "vllm": vllm.__version__, "dtype": str(config.dtype), "quantization": config.quantization,
            "load_seconds": load_seconds, "results": results}


def one_line(exc: BaseException) -> str:
    """``Type: first line``; for a pydantic ValidationError (vLLM's config checks) its first "Value error" line,
    which says what was wrong."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    detail = next((line for line in text[1:] if line.startswith("Value error")), None)
    if detail is None and text:
        detail = text[0]
        for line in text[1:]:  # "... Reasons:" goes on with the reasons: keep them, on the one line
            if not detail.endswith(":") or len(detail) > 400:
                break
            detail += " " + line
    return f"{type(exc).__name__}: {detail or ''}"


def main() -> None:
    request_path, result_path = sys.argv[1:3]
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    with open(request_path) as f:
        request = json.load(f)
    try:
        result = run(request)
    except Exception as exc:  # noqa: BLE001 — vLLM's refusal, reported to the parent as one line
        result = {"ok": False, "error": one_line(exc)}
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    sys.stdout.flush()
    os._exit(0)  # vLLM's background threads can hold a normal exit


if __name__ == "__main__":
    main()
