"""Sliding-window perplexity and KL divergence against a reference model.

Protocol. The token stream is cut into windows of at most ``ctx`` tokens whose starts are ``stride``
apart (the Hugging Face sliding-window recipe). Each window is fed to the model as is: no BOS is
added and no attention mask is passed. A window scores only the targets after the previous window's
end, so everything before them in the window is context, and every position ``1..n-1`` is scored
exactly once (position 0 has nothing to be predicted from). When ``stride == ctx`` consecutive windows
share one token, the context of the first new target, so no position is lost at window boundaries.
Perplexity is ``exp`` of the mean negative log-likelihood over the scored tokens.

KLD. With a ``reference`` model, both models see the same windows and, for every scored target, the
KL divergence of the model's next-token distribution from the reference's is taken:
``KL(P_ref || P_model) = sum_v p_ref(v) * (log p_ref(v) - log p_model(v))``, the figure llama.cpp
reports. It is 0 for identical models and grows as the model's predictions drift from the
reference's. The mean over all scored tokens and the 99th percentile are reported, together with
the reference's own perplexity on the same tokens, and the model's acceptance rates as a draft of the
reference in speculative decoding (`compress.eval.speculative`): greedy, the share of positions where both
predict the same most likely token; sampled at temperature 1, the mean of ``sum_v min(p_ref(v), p(v))``.

Memory. Log-probabilities are taken from the logits `POSITION_CHUNK` positions at a time, in float32
(the log-softmax shifts by the row maximum, and a KL term is a difference of two such values), so beyond
the forward passes' own logits an evaluation holds only chunk x vocabulary temporaries, however long the
windows or large the batch. A saved reference (``reference_cache``, `compress.eval.reference_cache`)
replaces the reference's forward passes by its stored top-k log-probabilities.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from compress.errors import CompressError
from compress.eval.reference_cache import ReferenceCache, kld_from_top_k, top_k_of


@dataclass(frozen=True)
class Window:
    """Token positions ``[begin, end)`` are fed; targets ``score_from..end-1`` are scored."""

    begin: int
    end: int
    score_from: int


def sliding_windows(n_tokens: int, ctx: int, stride: int) -> list[Window]:
    """The windows covering ``n_tokens`` tokens; every position 1..n-1 is scored by exactly one."""
    if ctx < 2:
        raise CompressError(f"context length {ctx} is too short: use ctx >= 2")
    if not 1 <= stride <= ctx:
        raise CompressError(f"stride {stride} is out of range: use 1 <= stride <= ctx ({ctx})")
    if n_tokens < 2:
        raise CompressError(f"only {n_tokens} token(s) to evaluate: give at least 2 tokens")
    windows: list[Window] = []
    begin, prev_end = 0, 0
    while True:
        end = min(begin + ctx, n_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        if end == n_tokens:
            return windows
        # With stride == ctx, start one token early so the first new target keeps its context.
        begin, prev_end = min(begin + stride, end - 1), end


@dataclass
class EvalResult:
    perplexity: float
    mean_nll: float
    tokens_scored: int
    windows: int
    seconds: float
    tokens_per_second: float
    kld: float | None = None  # mean per-token KLD vs the reference, when one was given
    kld_p99: float | None = None  # 99th percentile of the per-token KLD
    ref_perplexity: float | None = None  # the reference's perplexity on the same tokens
    # as a draft of the reference (speculative decoding): the share of scored positions where both models' most
    # likely token agree (greedy acceptance) and the mean of sum_v min(p_ref, p) (acceptance when sampling at T=1)
    acceptance: float | None = None
    acceptance_t1: float | None = None
    kv_cache: str | None = None  # the KV-cache format simulated in the model's attention (eval.kv_cache), if any

    def to_dict(self) -> dict:
        return asdict(self)


def _batches(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of equal length, at most ``batch_size`` per batch."""
    batches: list[list[Window]] = []
    for w in windows:
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and last[0].end - last[0].begin == w.end - w.begin:
            last.append(w)
        else:
            batches.append([w])
    return batches


POSITION_CHUNK = 128  # scored positions per log-softmax: temporaries stay chunk x vocab, whatever the window


def _scored_chunks(
    model, reference, tokens: torch.Tensor, windows: list[Window], batch_size: int, device, on_batch
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``(first target position, targets, log_probs, ref_log_probs)`` per run of at most `POSITION_CHUNK`
    scored targets, in position order: float32 log-softmax over the vocabulary of the predicting positions,
    taken from the batch's logits one chunk at a time (never for a whole window)."""
    done = 0
    for batch in _batches(windows, batch_size):
        input_ids = torch.stack([tokens[w.begin : w.end] for w in batch]).to(device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        ref_logits = reference(input_ids=input_ids, use_cache=False).logits if reference is not None else None
        if ref_logits is not None and ref_logits.shape[-1] != logits.shape[-1]:
            raise CompressError(
                f"model vocab size {logits.shape[-1]} differs from the reference's "
                f"{ref_logits.shape[-1]}: compare models that share a tokenizer"
            )
        for row, w in enumerate(batch):
            for first in range(w.score_from, w.end, POSITION_CHUNK):
                last = min(first + POSITION_CHUNK, w.end)
                predicting = slice(first - w.begin - 1, last - w.begin - 1)  # position i predicts token i + 1
                targets = input_ids[row, first - w.begin : last - w.begin]
                log_probs = logits[row, predicting].float().log_softmax(dim=-1)
                ref_log_probs = ref_logits[row, predicting].float().log_softmax(dim=-1) if ref_logits is not None else None
                yield first, targets, log_probs, ref_log_probs
        del logits, ref_logits
        done += len(batch)
        if on_batch is not None:
            on_batch(done, len(windows))


def kld_from_log_probs(ref_log_probs: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """Per row, ``KL(P_ref || P) = sum_v p_ref(v) (log p_ref(v) - log p(v))`` from float32 log-softmaxes
    [rows, V] -> [rows]. Both come max-shifted from log_softmax, so the difference of two log-probabilities
    loses no more than float32 rounding of each; identical inputs give exactly 0."""
    return (ref_log_probs.exp() * (ref_log_probs - log_probs)).sum(dim=-1)


@contextmanager
def _eval_mode(model) -> Iterator[None]:
    """Switch dropout and the like off for the evaluation, restoring the caller's mode after."""
    was_training = isinstance(model, torch.nn.Module) and model.training
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train()


def _nll(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _protocol(token_ids: torch.Tensor, ctx: int, stride: int | None, batch_size: int) -> tuple[list[Window], int]:
    if token_ids.dim() != 1:
        raise CompressError(f"token_ids has shape {tuple(token_ids.shape)}: pass a 1-D tensor of token ids")
    if batch_size < 1:
        raise CompressError(f"batch size {batch_size} is invalid: use batch_size >= 1")
    stride = ctx if stride is None else stride
    return sliding_windows(len(token_ids), ctx, stride), stride


def _result(nll_sum: float, n_scored: int, windows: int, seconds: float) -> EvalResult:
    mean_nll = nll_sum / n_scored
    return EvalResult(
        perplexity=math.exp(mean_nll),
        mean_nll=mean_nll,
        tokens_scored=n_scored,
        windows=windows,
        seconds=seconds,
        tokens_per_second=n_scored / seconds if seconds > 0 else float("inf"),
    )


def evaluate(
    model,
    token_ids: torch.Tensor,
    ctx: int = 512,
    stride: int | None = None,
    batch_size: int = 8,
    reference=None,
    device: str | torch.device = "cpu",
    on_batch: Callable[[int, int], None] | None = None,
    reference_cache: ReferenceCache | None = None,
) -> EvalResult:
    """Perplexity of ``model`` on ``token_ids`` (1-D), and its KLD from ``reference`` if given.

    ``reference_cache`` (`compress.eval.reference_cache`) stands in for ``reference`` without running it:
    its KLD is the top-k approximation, a lower bound of the full KLD (equal at k = vocabulary size)."""
    windows, stride = _protocol(token_ids, ctx, stride, batch_size)
    if reference is not None and reference_cache is not None:
        raise CompressError("both a reference model and a reference cache were given: pass one of them")
    tokens = token_ids.long()
    if reference_cache is not None:
        reference_cache.check_matches(tokens, ctx, stride)
    nll_sum, ref_nll_sum, n_scored = 0.0, 0.0, 0
    agree, overlap = 0, 0.0  # greedy agreements; sum over positions of sum_v min(p_ref, p)
    klds: list[torch.Tensor] = []
    start = time.perf_counter()
    with torch.inference_mode(), _eval_mode(model), _eval_mode(reference):
        for first, targets, log_probs, ref_log_probs in _scored_chunks(model, reference, tokens, windows, batch_size, device, on_batch):
            nll_sum += _nll(log_probs, targets).double().sum().item()
            n_scored += len(targets)
            if ref_log_probs is not None:
                ref_nll_sum += _nll(ref_log_probs, targets).double().sum().item()
                klds.append(kld_from_log_probs(ref_log_probs, log_probs).cpu())
                agree += int((ref_log_probs.argmax(dim=-1) == log_probs.argmax(dim=-1)).sum())
                overlap += torch.minimum(ref_log_probs, log_probs).exp().sum(dim=-1).double().sum().item()
            elif reference_cache is not None:
                reference_cache.check_vocab(log_probs.shape[-1])
                rows = slice(first - 1, first - 1 + len(targets))  # row t - 1 holds target position t
                ref_nll_sum -= reference_cache.target_log_prob[rows].double().sum().item()
                cached = [getattr(reference_cache, name)[rows].to(log_probs.device) for name in ("top_ids", "top_log_probs", "rest_log_prob")]
                klds.append(kld_from_top_k(log_probs, *cached).cpu())
                agree += int((cached[0][:, 0].long() == log_probs.argmax(dim=-1)).sum())  # top-1 is stored first
    result = _result(nll_sum, n_scored, len(windows), time.perf_counter() - start)
    if klds:
        per_token = torch.cat(klds).double()
        result.kld = per_token.mean().item()
        result.kld_p99 = float(np.percentile(per_token.numpy(), 99))
        result.ref_perplexity = math.exp(ref_nll_sum / n_scored)
        result.acceptance = agree / n_scored
        # sum_v min(p_ref, p) needs the whole distributions: not from a top-k cache
        result.acceptance_t1 = overlap / n_scored if reference_cache is None else None
    return result


def build_reference_cache(
    reference,
    token_ids: torch.Tensor,
    ctx: int = 512,
    stride: int | None = None,
    top_k: int = 256,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    on_batch: Callable[[int, int], None] | None = None,
    text_sha256: str = "",
    source: str = "",
) -> tuple[ReferenceCache, EvalResult]:
    """Run ``reference`` once over the windows and keep, per scored token, its ``top_k`` log-probabilities,
    the log of the rest of its mass and its log-probability of the target (`compress.eval.reference_cache`).
    Also returns the reference's own perplexity."""
    windows, stride = _protocol(token_ids, ctx, stride, batch_size)
    if top_k < 1:
        raise CompressError(f"top-k {top_k} is invalid: use top_k >= 1")
    tokens = token_ids.long()
    n_rows = len(tokens) - 1
    top_ids = top_log_probs = None
    rest, target_lp = torch.empty(n_rows), torch.empty(n_rows)
    nll_sum, n_scored = 0.0, 0
    start = time.perf_counter()
    with torch.inference_mode(), _eval_mode(reference):
        for first, targets, log_probs, _ in _scored_chunks(reference, None, tokens, windows, batch_size, device, on_batch):
            vocab = log_probs.shape[-1]
            if top_ids is None:
                if top_k > vocab:
                    raise CompressError(f"top-k {top_k} exceeds the vocabulary size {vocab}: use top_k <= {vocab}")
                top_ids, top_log_probs = torch.empty(n_rows, top_k, dtype=torch.int32), torch.empty(n_rows, top_k)
            rows = slice(first - 1, first - 1 + len(targets))
            ids, values, rest_lp = top_k_of(log_probs, top_k)
            top_ids[rows], top_log_probs[rows], rest[rows] = ids.to(torch.int32).cpu(), values.cpu(), rest_lp.cpu()
            nll = _nll(log_probs, targets)
            target_lp[rows] = -nll.cpu()
            nll_sum += nll.double().sum().item()
            n_scored += len(targets)
    result = _result(nll_sum, n_scored, len(windows), time.perf_counter() - start)
    cache = ReferenceCache(
        token_ids=tokens.cpu(), ctx=ctx, stride=stride, vocab_size=vocab, top_ids=top_ids,
        top_log_probs=top_log_probs, rest_log_prob=rest, target_log_prob=target_lp, text_sha256=text_sha256, source=source,
    )
    return cache, result
