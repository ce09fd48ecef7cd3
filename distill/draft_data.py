"""Training data for draft models: sequences the teacher generates itself, cached on disk and resumable.

A draft model is judged on the tokens its target produces while serving, not on human text (DistillSpec,
Zhou et al. 2024, arXiv:2310.08461: on-policy data from the teacher raises acceptance). Prompts are
``draft_prompts`` windows of ``draft_prompt_tokens`` tokens drawn (seeded) from the training text; the
teacher continues each to ``seq_len`` tokens at the serving temperature (greedy at 0; no top-k/top-p;
end-of-text suppressed so every sequence has the full length).

Cache. Batches are written one file at a time (``batch-00000.safetensors``: ``input_ids [b, seq_len]``,
renamed into place only when complete) next to ``settings.json``, which records what defines them. A
run finds the batches already there and generates only the missing ones; batch ``i`` is sampled with a
generator seeded from ``(seed, i)``, so an interrupted and resumed cache equals an uninterrupted one.
Different settings in an existing cache are a one-line error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from compress.distill.config import DistillSpec
from compress.errors import CompressError

SETTINGS = "settings.json"


def _settings(teacher_dir: Path, spec: DistillSpec) -> dict:
    return {"teacher": str(Path(teacher_dir).resolve()), "data": str(Path(spec.data).resolve()), "prompts": spec.draft_prompts,
            "prompt_tokens": spec.draft_prompt_tokens, "seq_len": spec.seq_len, "temperature": spec.draft_temperature,
            "seed": spec.seed, "batch_size": spec.batch_size}


def draft_prompts(tokens: torch.Tensor, spec: DistillSpec) -> torch.Tensor:
    """``[draft_prompts, draft_prompt_tokens]`` disjoint windows of the 1-D ``tokens``, chosen seeded."""
    n = tokens.numel() // spec.draft_prompt_tokens
    if n < spec.draft_prompts:
        raise CompressError(f"the training text has {n} windows of {spec.draft_prompt_tokens} tokens, fewer than "
                            f"draft_prompts {spec.draft_prompts}: give more text or fewer prompts")
    windows = tokens[: n * spec.draft_prompt_tokens].view(n, spec.draft_prompt_tokens)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(spec.seed))[: spec.draft_prompts]
    return windows[order.sort().values]


@torch.inference_mode()
def teacher_sequences(teacher, teacher_dir: Path, tokens: torch.Tensor, spec: DistillSpec, cache: Path,
                      progress: Callable[[str, int, int], None] | None = None) -> torch.Tensor:
    """The teacher's sequences ``[draft_prompts, seq_len]`` (prompt, then its continuation), from ``cache``
    where present, generated (and cached) where not."""
    progress = progress or (lambda phase, done, total: None)
    settings = _settings(teacher_dir, spec)
    cache.mkdir(parents=True, exist_ok=True)
    recorded = cache / SETTINGS
    if recorded.is_file():
        before = json.loads(recorded.read_text())
        changed = sorted(k for k in settings if before.get(k) != settings[k])
        if changed:
            raise CompressError(f"draft cache {cache} holds sequences made with other {', '.join(changed)}: "
                                "delete it, or pass another --draft-cache")
    else:
        recorded.write_text(json.dumps(settings, indent=1) + "\n")
    prompts = draft_prompts(tokens, spec)
    batches = prompts.split(spec.batch_size)
    new = spec.seq_len - spec.draft_prompt_tokens
    device = next(teacher.parameters()).device
    sampling = ({"do_sample": True, "temperature": spec.draft_temperature, "top_k": 0, "top_p": 1.0}
                if spec.draft_temperature > 0 else {"do_sample": False})
    for i, batch in enumerate(batches):
        path = _batch_path(cache, i)
        if not path.is_file():
            torch.manual_seed(spec.seed * 1_000_003 + i)
            prompts_on = batch.to(device)  # equal lengths: no padding, every position attended
            ids = teacher.generate(prompts_on, attention_mask=torch.ones_like(prompts_on), max_new_tokens=new, min_new_tokens=new,
                                   pad_token_id=teacher.config.eos_token_id, **sampling).cpu()
            partial = path.with_suffix(".partial")
            save_file({"input_ids": ids.contiguous()}, str(partial))
            os.replace(partial, path)  # a batch exists only once complete
        progress("teacher generation", i + 1, len(batches))
    return cached_sequences(cache, spec)


def _batch_path(cache: Path, index: int) -> Path:
    return cache / f"batch-{index:05d}.safetensors"


def cached_sequences(cache: Path, spec: DistillSpec) -> torch.Tensor:
    """The complete cache's sequences ``[draft_prompts, seq_len]`` (written by `teacher_sequences`)."""
    batches = -(-spec.draft_prompts // spec.batch_size)
    missing = [i for i in range(batches) if not _batch_path(cache, i).is_file()]
    if missing:
        raise CompressError(f"draft cache {cache} lacks batch {missing[0]}: run again to generate it")
    sequences = torch.cat([load_file(str(_batch_path(cache, i)))["input_ids"] for i in range(batches)])
    if sequences.shape != (spec.draft_prompts, spec.seq_len):
        raise CompressError(f"draft cache {cache} holds sequences of shape {tuple(sequences.shape)}: delete it and run again")
    return sequences
