"""Perplexity and KLD of a checkpoint on disk: `evaluate` around the model and tokenizer loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from compress.checkpoints.loading import load_model, load_tokenizer, read_eval_text, resolve_device
from compress.errors import CompressError
from compress.eval.kv_cache import kv_cache_context, resolve_kv_cache
from compress.eval.perplexity import EvalResult, evaluate
from compress.quantizers.kv_cache import KVCacheFormat


def evaluate_checkpoint(
    model_path: Path,
    text_path: Path,
    ctx: int = 512,
    stride: int | None = None,
    batch_size: int = 8,
    reference_path: Path | None = None,
    device: str = "cpu",
    max_tokens: int | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    kv_cache: KVCacheFormat | str | None = None,
) -> EvalResult:
    """Perplexity of ``model_path`` on ``text_path`` (and KLD from ``reference_path``'s predictions).

    ``kv_cache``: a KV-cache format to simulate in the model's attention, ``"none"``, or None for the
    checkpoint's own calibrated KV-cache scheme if it has one (`compress.eval.kv_cache`); the reference
    always runs unquantized."""
    dev = resolve_device(device)
    tokenizer = load_tokenizer(model_path)
    ids = tokenizer(read_eval_text(text_path), add_special_tokens=False, verbose=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    tokens = torch.tensor(ids, dtype=torch.long)
    model = load_model(model_path, dev)
    setting = resolve_kv_cache(model_path, model, kv_cache)
    reference = load_model(reference_path, dev) if reference_path is not None else None
    if reference is not None and load_tokenizer(reference_path).get_vocab() != tokenizer.get_vocab():
        raise CompressError(f"{model_path} and {reference_path} have different tokenizers: KLD needs the same one")
    with kv_cache_context(setting, model):
        result = evaluate(model, tokens, ctx=ctx, stride=stride, batch_size=batch_size, reference=reference, device=dev, on_batch=on_batch)
    result.kv_cache = setting.describe() if setting is not None else None
    return result
