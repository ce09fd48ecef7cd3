"""Independent views of a GGUF file for the tests: gguf-py's reader, transformers' loader, llama.cpp."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch


def read_fields(path: Path) -> dict:
    """Scalar and string-array metadata of a GGUF file, as gguf-py's reader decodes it."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except Exception:  # some field kinds have no python form; not needed here
            continue
    return out


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def transformers_model(path: Path):
    """The GGUF file loaded by transformers (it dequantizes with gguf-py and undoes the Q/K permutation)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def llamacpp_model(path: Path, n_ctx: int = 512):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False, n_threads=2, seed=0)


def llamacpp_window_log_probs(llm, tokens: list[int], windows) -> list[np.ndarray]:
    """llama.cpp's log-probabilities (float64) of the scored positions of each window, fed without BOS."""
    out = []
    for w in windows:
        llm.reset()
        llm.eval(tokens[w.begin : w.end])
        logits = np.asarray(llm.scores[: w.end - w.begin], dtype=np.float64)
        logits = logits[w.score_from - w.begin - 1 : w.end - w.begin - 1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        out.append(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))
    return out


def llamacpp_perplexity(path: Path, tokens: list[int], ctx: int = 512) -> float:
    """Sliding-window perplexity from llama.cpp's own logits, windows as our evaluator cuts them."""
    from compress.eval.perplexity import sliding_windows

    windows = sliding_windows(len(tokens), ctx, ctx)
    llm = llamacpp_model(path, ctx)
    nll, count = 0.0, 0
    for w, lp in zip(windows, llamacpp_window_log_probs(llm, tokens, windows)):
        targets = np.asarray(tokens[w.score_from : w.end])
        nll -= lp[np.arange(len(targets)), targets].sum()
        count += len(targets)
    llm.close() if hasattr(llm, "close") else None
    return math.exp(nll / count)
