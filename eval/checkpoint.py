"""Perplexity and KLD of a checkpoint on disk: `evaluate` around the model and tokenizer loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from compress.checkpoints.loading import load_model, load_tokenizer, read_eval_text, resolve_device
from compress.errors import CompressError
from compress.eval.kv_cache import kv_cache_context, resolve_kv_cache
from compress.eval.perplexity import EvalResult, build_reference_cache, evaluate
from compress.eval.reference_cache import load_reference_cache, save_reference_cache, text_digest, writable_cache_path
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
    reference_cache_path: Path | None = None,
) -> EvalResult:
    """Perplexity of ``model_path`` on ``text_path`` (and KLD from ``reference_path``'s predictions).

    ``kv_cache``: a KV-cache format to simulate in the model's attention, ``"none"``, or None for the
    checkpoint's own calibrated KV-cache scheme if it has one (`compress.eval.kv_cache`); the reference
    always runs unquantized.

    ``reference_cache_path``: a file `save_reference_checkpoint` wrote, instead of ``reference_path``: KLD
    from the reference's stored top-k log-probabilities (a lower bound of the full KLD, see
    `compress.eval.reference_cache`), without loading the reference."""
    if reference_path is not None and reference_cache_path is not None:
        raise CompressError("--reference and --reference-cache were both given: pass one of them")
    dev = resolve_device(device)
    cache = load_reference_cache(reference_cache_path) if reference_cache_path is not None else None
    tokenizer = load_tokenizer(model_path)
    tokens, digest = _tokens(tokenizer, text_path, max_tokens)
    if cache is not None and cache.text_sha256 and cache.text_sha256 != digest:
        raise CompressError(
            f"reference cache {cache.source} was saved from another text (sha256 {cache.text_sha256[:12]}..., "
            f"{text_path} has {digest[:12]}...): give the --text it was saved from, or save the reference again"
        )
    model = load_model(model_path, dev)
    setting = resolve_kv_cache(model_path, model, kv_cache)
    reference = load_model(reference_path, dev) if reference_path is not None else None
    if reference is not None and load_tokenizer(reference_path).get_vocab() != tokenizer.get_vocab():
        raise CompressError(f"{model_path} and {reference_path} have different tokenizers: KLD needs the same one")
    with kv_cache_context(setting, model):
        result = evaluate(model, tokens, ctx=ctx, stride=stride, batch_size=batch_size, reference=reference, device=dev,
                          on_batch=on_batch, reference_cache=cache)
    result.kv_cache = setting.describe() if setting is not None else None
    return result


def _tokens(tokenizer, text_path: Path, max_tokens: int | None) -> tuple[torch.Tensor, str]:
    """The text's token ids (`token_ids`) and the text's SHA-256."""
    text = read_eval_text(text_path)
    return token_ids(tokenizer, text, max_tokens), text_digest(text)


def token_ids(tokenizer, text: str, max_tokens: int | None) -> torch.Tensor:
    """The evaluation text's token ids as `compress eval ppl` scores them: no BOS, the first ``max_tokens``."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def save_reference_checkpoint(
    reference_path: Path,
    text_path: Path,
    output: Path,
    ctx: int = 512,
    stride: int | None = None,
    top_k: int = 256,
    batch_size: int = 8,
    device: str = "cpu",
    max_tokens: int | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    source: str | None = None,
) -> tuple[EvalResult, Path]:
    """Run ``reference_path`` (unquantized KV cache) once on ``text_path`` and write its top-k log-probabilities
    for later ``reference_cache_path=`` evaluations (`compress.eval.reference_cache`) to ``output`` (a file,
    or a directory to hold ``reference_top_k.safetensors``), atomically. Returns its own perplexity and the file."""
    writable_cache_path(output)
    dev = resolve_device(device)
    tokens, digest = _tokens(load_tokenizer(reference_path), text_path, max_tokens)
    reference = load_model(reference_path, dev)
    cache, result = build_reference_cache(
        reference, tokens, ctx=ctx, stride=stride, top_k=top_k, batch_size=batch_size, device=dev,
        on_batch=on_batch, text_sha256=digest, source=source or str(reference_path),
    )
    return result, save_reference_cache(cache, output)
