"""`compress report --backend vllm`: every row's perplexity scored by vLLM (`compress.eval.vllm_backend`).

The protocol is the report's (`compress.eval.report`): the baseline's tokenizer makes the token ids once, and
vLLM scores the same windows and targets for the baseline and every checkpoint, each in its own child process.
vLLM gives the targets' log-probabilities only, so the rows have perplexity and no KLD or draft acceptance.
A checkpoint vLLM refuses or dies on is a row ``vLLM: unsupported here (reason)`` with no figures; a GGUF file
is such a row too (score it with the default backend). Nothing is scored by another evaluator in its place.
"""

from __future__ import annotations

import logging
from pathlib import Path

from compress.eval.report import Protocol, ProgressFn, Report, Row, checkpoint_figures, gguf_figures, tokenize
from compress.eval.vllm_backend import VllmRefused, VllmSettings, evaluate_vllm, kv_cache_dtype_for

log = logging.getLogger(__name__)


def evaluator_label(settings: VllmSettings) -> str:
    return f"vLLM ({settings.dtype})"


def unsupported(reason: str) -> str:
    return f"vLLM: unsupported here ({reason})"


def _row(path: Path, kind: str, settings: VllmSettings, tokens, protocol: Protocol, fig: dict) -> Row:
    label = evaluator_label(settings)
    result, evaluator = None, label
    if kind == "gguf":
        evaluator = unsupported("a GGUF file: score it with --backend ours")
    else:
        run = VllmSettings(settings.python, settings.dtype, kv_cache_dtype_for(path, protocol.kv_cache), settings.timeout, settings.extra)
        try:
            result = evaluate_vllm(path, tokens, protocol.ctx, protocol.stride, run, label=str(path))
        except VllmRefused as refusal:
            log.warning("%s", refusal)
            evaluator = unsupported(refusal.reason)
    return Row(
        "baseline" if kind == "baseline" else path.name, str(path), kind, evaluator,
        None if result is None else result.perplexity, None, None, 0 if result is None else result.tokens_scored,
        fig["size_bytes"], fig["bits_per_weight"], fig["bits_source"], fig["sparsity"],
        "uncompressed" if kind == "baseline" else fig["description"],
    )


def evaluate_outputs_vllm(outputs: list[Path], baseline: Path, protocol: Protocol, settings: VllmSettings,
                          progress: ProgressFn | None = None) -> Report:
    """The report of ``outputs`` and ``baseline`` with every perplexity from vLLM (see the module docstring)."""
    tokens = tokenize(baseline, protocol)
    total = len(outputs) + 1
    base = _row(baseline, "baseline", settings, tokens, protocol, checkpoint_figures(baseline))
    if progress:
        progress("vLLM", 1, total)
    rows = []
    for i, path in enumerate(outputs):
        kind = "gguf" if path.is_file() else "checkpoint"
        rows.append(_row(path, kind, settings, tokens, protocol, gguf_figures(path) if kind == "gguf" else checkpoint_figures(path)))
        if progress:
            progress("vLLM", i + 2, total)
    protocol_dict = {**protocol.to_dict(), "baseline": str(baseline), "tokens": len(tokens), "backend": evaluator_label(settings)}
    return Report(base, rows, protocol_dict)
