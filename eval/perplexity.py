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
the reference's own perplexity on the same tokens.
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


def _scored_log_probs(model, input_ids: torch.Tensor, batch: list[Window]) -> list[torch.Tensor]:
    """Per window, float32 log-softmax over the vocabulary at the positions predicting scored targets."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    out = []
    for row, w in enumerate(batch):
        lo, hi = w.score_from - w.begin - 1, w.end - w.begin - 1
        out.append(logits[row, lo:hi].float().log_softmax(dim=-1))
    return out


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


def _nll(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    return -log_probs.gather(-1, targets.unsqueeze(-1)).double().sum().item()


def evaluate(
    model,
    token_ids: torch.Tensor,
    ctx: int = 512,
    stride: int | None = None,
    batch_size: int = 8,
    reference=None,
    device: str | torch.device = "cpu",
    on_batch: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Perplexity of ``model`` on ``token_ids`` (1-D), and its KLD from ``reference`` if given."""
    if token_ids.dim() != 1:
        raise CompressError(f"token_ids has shape {tuple(token_ids.shape)}: pass a 1-D tensor of token ids")
    if batch_size < 1:
        raise CompressError(f"batch size {batch_size} is invalid: use batch_size >= 1")
    windows = sliding_windows(len(token_ids), ctx, ctx if stride is None else stride)
    tokens = token_ids.long()
    nll_sum, ref_nll_sum, n_scored, done = 0.0, 0.0, 0, 0
    klds: list[torch.Tensor] = []
    start = time.perf_counter()
    with torch.inference_mode(), _eval_mode(model), _eval_mode(reference):
        for batch in _batches(windows, batch_size):
            input_ids = torch.stack([tokens[w.begin : w.end] for w in batch]).to(device)
            log_probs = _scored_log_probs(model, input_ids, batch)
            ref_log_probs = _scored_log_probs(reference, input_ids, batch) if reference is not None else None
            for i, w in enumerate(batch):
                targets = input_ids[i, w.score_from - w.begin : w.end - w.begin]
                nll_sum += _nll(log_probs[i], targets)
                n_scored += len(targets)
                if ref_log_probs is None:
                    continue
                ref_lp = ref_log_probs[i]
                if ref_lp.shape[-1] != log_probs[i].shape[-1]:
                    raise CompressError(
                        f"model vocab size {log_probs[i].shape[-1]} differs from the reference's "
                        f"{ref_lp.shape[-1]}: compare models that share a tokenizer"
                    )
                ref_nll_sum += _nll(ref_lp, targets)
                ref_lp, lp = ref_lp.double(), log_probs[i].double()
                klds.append((ref_lp.exp() * (ref_lp - lp)).sum(dim=-1).cpu())
            done += len(batch)
            if on_batch is not None:
                on_batch(done, len(windows))
    seconds = time.perf_counter() - start
    mean_nll = nll_sum / n_scored
    result = EvalResult(
        perplexity=math.exp(mean_nll),
        mean_nll=mean_nll,
        tokens_scored=n_scored,
        windows=len(windows),
        seconds=seconds,
        tokens_per_second=n_scored / seconds if seconds > 0 else float("inf"),
    )
    if reference is not None:
        per_token = torch.cat(klds)
        result.kld = per_token.mean().item()
        result.kld_p99 = float(np.percentile(per_token.numpy(), 99))
        result.ref_perplexity = math.exp(ref_nll_sum / n_scored)
    return result
