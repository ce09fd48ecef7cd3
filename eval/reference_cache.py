"""The reference model's top-k next-token log-probabilities, kept on disk so KLD needs no reference run.

Evaluating ten compressed outputs against one reference with ``--reference`` runs the reference ten
times. As llama.cpp's ``llama-perplexity --kl-divergence-base`` does, ``compress eval ppl REF
--save-reference FILE`` runs it once and stores, for every scored token ``t`` (row ``t - 1``; every
position ``1..n-1`` is scored exactly once by the sliding windows, in order):

- ``top_ids`` [n-1, k] int32, ``top_log_probs`` [n-1, k] float32: the reference's k most likely next
  tokens and their log-probabilities (descending);
- ``rest_log_prob`` [n-1] float32: ``log`` of the probability mass outside those k (``-inf`` when k is
  the vocabulary size), taken as a log-sum-exp over the other tokens, not as ``log(1 - sum)``;
- ``target_log_prob`` [n-1] float32: the reference's log-probability of the true token (its perplexity);
- ``token_ids`` [n] int64 and, in the metadata, ctx, stride, k, vocabulary size and the text's SHA-256,
  so a cache used with other tokens or windows is a one-line error instead of a wrong figure.

KLD from the cache (`kld_from_top_k`). The reference's distribution is coarsened to k + 1 outcomes: its
top-k tokens and "anything else" (mass ``r``), and the model's distribution over the same k + 1 outcomes:

    KL_k = sum_{v in top-k} p_ref(v) (log p_ref(v) - log p(v)) + r_ref (log r_ref - log r_model)

By the data-processing inequality (merging outcomes never increases a KL divergence) ``KL_k <= KL``,
with equality at k = vocabulary size; the gap is the divergence hidden inside the reference's tail,
small when k covers nearly all of its mass (k = 64 on a 49k vocabulary typically leaves a few percent).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.errors import CompressError

FORMAT = "llm-compress-reference-top-k"
VERSION = "1"
DEFAULT_FILE_NAME = "reference_top_k.safetensors"
TENSORS = ("token_ids", "top_ids", "top_log_probs", "rest_log_prob", "target_log_prob")


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ReferenceCache:
    """One reference's top-k log-probabilities for every scored token of one text under one window protocol."""

    token_ids: torch.Tensor  # [n] int64
    ctx: int
    stride: int
    vocab_size: int
    top_ids: torch.Tensor  # [n-1, k] int32
    top_log_probs: torch.Tensor  # [n-1, k] float32
    rest_log_prob: torch.Tensor  # [n-1] float32
    target_log_prob: torch.Tensor  # [n-1] float32
    text_sha256: str = ""
    source: str = ""  # the reference it came from, for messages

    @property
    def top_k(self) -> int:
        return self.top_ids.shape[-1]

    def check_matches(self, token_ids: torch.Tensor, ctx: int, stride: int) -> None:
        """A one-line error unless this cache was computed on ``token_ids`` with the same windows."""
        where = f"reference cache {self.source}" if self.source else "the reference cache"
        if (ctx, stride) != (self.ctx, self.stride):
            raise CompressError(
                f"{where} was computed with ctx {self.ctx}, stride {self.stride}, not ctx {ctx}, stride {stride}: "
                f"evaluate with --ctx {self.ctx} --stride {self.stride} or save the reference again"
            )
        if not torch.equal(token_ids.long().cpu(), self.token_ids):
            raise CompressError(
                f"{where} holds other token ids ({len(self.token_ids)} tokens, here {len(token_ids)}): use the text, "
                "tokenizer and --max-tokens it was saved with, or save the reference again"
            )

    def check_vocab(self, vocab_size: int) -> None:
        if vocab_size != self.vocab_size:
            where = f"reference cache {self.source}" if self.source else "the reference cache"
            raise CompressError(
                f"model vocab size {vocab_size} differs from the {self.vocab_size} of {where}: "
                "compare models that share a tokenizer"
            )


def top_k_of(log_probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, log_probs, rest_log_prob)`` of the k most likely tokens per row of ``log_probs`` [rows, V]:
    [rows, k] int64, [rows, k] and [rows]; the rest is a log-sum-exp over the other tokens."""
    values, ids = log_probs.topk(k, dim=-1)
    rest = log_probs.scatter(-1, ids, float("-inf")).logsumexp(dim=-1)
    return ids, values, rest


def kld_from_top_k(
    log_probs: torch.Tensor, top_ids: torch.Tensor, top_log_probs: torch.Tensor, rest_log_prob: torch.Tensor
) -> torch.Tensor:
    """Per row, KL of the model's distribution from the reference's, both coarsened to the reference's top-k
    tokens plus one "rest" outcome (module docstring): a lower bound of the full KL, equal to it at k = V.

    ``log_probs`` [rows, V] the model's log-softmax; ``top_ids`` [rows, k]; ``top_log_probs`` [rows, k] and
    ``rest_log_prob`` [rows] the reference's. Returns [rows]."""
    ids = top_ids.long()
    model_top = log_probs.gather(-1, ids)
    model_rest = log_probs.scatter(-1, ids, float("-inf")).logsumexp(dim=-1)
    inside = (top_log_probs.exp() * (top_log_probs - model_top)).sum(dim=-1)
    ref_rest = rest_log_prob.exp()
    # 0 * log(0 / q) = 0: no rest mass (k = V) contributes nothing, even where the model has none either.
    outside = torch.where(ref_rest > 0, ref_rest * (rest_log_prob - model_rest), torch.zeros_like(ref_rest))
    return inside + outside


def cache_path(path: Path) -> Path:
    """``path`` itself, or the default file name inside it when it is a directory."""
    return path / DEFAULT_FILE_NAME if path.is_dir() else path


def _is_cache_file(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # not a safetensors file at all
        return False


def writable_cache_path(path: Path) -> Path:
    """The file `save_reference_cache` would write for ``path``; a one-line error if it cannot or must not
    (checked before the reference runs, and again when writing)."""
    path = cache_path(path)
    if not path.parent.is_dir():
        raise CompressError(f"folder {path.parent} does not exist: create it or give another --save-reference path")
    if path.exists() and not _is_cache_file(path):
        raise CompressError(f"{path} exists and is not a reference cache: give a new file name or a directory")
    return path


def save_reference_cache(cache: ReferenceCache, path: Path) -> Path:
    """Write ``cache`` to ``path`` (or into it, when a directory) atomically: a temporary file renamed into
    place. An existing file is replaced only when it is itself a reference cache. Returns the file written."""
    from safetensors.torch import save_file

    path = writable_cache_path(path)
    tensors = {
        "token_ids": cache.token_ids.long().contiguous(),
        "top_ids": cache.top_ids.to(torch.int32).contiguous(),
        "top_log_probs": cache.top_log_probs.float().contiguous(),
        "rest_log_prob": cache.rest_log_prob.float().contiguous(),
        "target_log_prob": cache.target_log_prob.float().contiguous(),
    }
    metadata = {
        "format": FORMAT, "version": VERSION, "ctx": str(cache.ctx), "stride": str(cache.stride),
        "vocab_size": str(cache.vocab_size), "top_k": str(cache.top_k), "text_sha256": cache.text_sha256,
        "source": cache.source,
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_reference_cache(path: Path) -> ReferenceCache:
    """Read a file `save_reference_cache` wrote; anything else is a one-line error."""
    from safetensors import safe_open

    path = cache_path(path)
    if not path.is_file():
        raise CompressError(f"reference cache {path} does not exist: write one with compress eval ppl REF --save-reference {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CompressError(f"{path} is not a reference cache: write one with compress eval ppl REF --save-reference")
            if meta.get("version") != VERSION:
                raise CompressError(f"reference cache {path} has version {meta.get('version')}, not {VERSION}: save the reference again")
            missing = [name for name in TENSORS if name not in f.keys()]
            if missing:
                raise CompressError(f"reference cache {path} lacks {', '.join(missing)}: save the reference again")
            t = {name: f.get_tensor(name) for name in TENSORS}
            ctx, stride, vocab = int(meta["ctx"]), int(meta["stride"]), int(meta["vocab_size"])
    except CompressError:
        raise
    except Exception as exc:  # truncated or corrupt file, missing metadata keys
        raise CompressError(f"reference cache {path} is unreadable ({type(exc).__name__}): save the reference again") from None
    n, k = len(t["token_ids"]), t["top_ids"].shape[-1] if t["top_ids"].dim() == 2 else -1
    shapes_ok = (
        t["token_ids"].dim() == 1 and n >= 2 and 1 <= k <= vocab
        and t["top_ids"].shape == t["top_log_probs"].shape == (n - 1, k)
        and t["rest_log_prob"].shape == t["target_log_prob"].shape == (n - 1,)
        and int(t["top_ids"].min()) >= 0 and int(t["top_ids"].max()) < vocab
    )
    if not shapes_ok:
        raise CompressError(f"reference cache {path} has inconsistent tensor shapes or ids: save the reference again")
    return ReferenceCache(
        token_ids=t["token_ids"].long(), ctx=ctx, stride=stride, vocab_size=vocab, top_ids=t["top_ids"],
        top_log_probs=t["top_log_probs"].float(), rest_log_prob=t["rest_log_prob"].float(),
        target_log_prob=t["target_log_prob"].float(), text_sha256=meta.get("text_sha256", ""), source=str(path),
    )
