"""The distillation training loop, on Hugging Face accelerate.

One process or many: under ``accelerate launch`` (or ``torchrun``) each process is a DDP rank, gradients
are averaged across ranks, and only the main process writes files. The global batch of step ``s`` is a
fixed, seeded choice of token windows (`batch_windows`): ``batch_size × processes × grad_accum``
windows, of which micro-batch ``m`` of rank ``r`` takes slice ``m·P + r``. So one process with batch
8 and two with batch 4 see the same windows per step and (every window has the same token count) the
same mean gradient; and a run resumed at step ``s`` sees exactly the batches it would have seen.

Per step: for each micro-batch, the teacher's final hidden states (no grad) and the student's, the
chunked loss of `compress.distill.loss` over the LM heads, backward (gradient sync only on the last
micro-batch); then masks applied to the gradients, clipping, AdamW, the LR schedule (linear warmup,
cosine to ``min_lr_ratio``), masks applied to the weights. Checkpoints (`accelerate` ``save_state``:
model, optimizer, scheduler, RNG) go to ``checkpoint_dir/step-N`` every ``save_every`` steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from compress.distill.config import DistillSpec, Objective, Precision
from compress.distill.loss import distillation_loss, draft_loss
from compress.distill.student import apply_masks
from compress.errors import CompressError

log = logging.getLogger(__name__)

# Settings that must not change between a run and its resumption (they define the trajectory).
TRAJECTORY_KEYS = ("tau", "alpha", "steps", "batch_size", "grad_accum", "seq_len", "lr", "warmup_steps",
                   "min_lr_ratio", "weight_decay", "max_grad_norm", "precision", "seed", "objective", "draft_loss",
                   "draft_temperature", "draft_prompts", "draft_prompt_tokens")


@dataclass
class StepLog:
    step: int  # 1-based: optimizer steps done
    loss: float  # mean over the global batch
    kd: float
    ce: float
    lr: float
    tokens_per_second: float


def token_windows(tokenizer, text: str, seq_len: int) -> torch.LongTensor:
    """All disjoint windows of ``seq_len`` tokens of ``text``: ``[n_windows, seq_len]``."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
    n = ids.numel() // seq_len
    if n < 1:
        raise CompressError(f"training text has {ids.numel()} tokens, fewer than one window of {seq_len}: give more text or lower seq_len")
    return ids[: n * seq_len].view(n, seq_len)


def batch_windows(n_windows: int, global_batch: int, step: int, seed: int) -> torch.LongTensor:
    """Window indices of the global batch of (0-based) ``step``: epochs of seeded permutations, laid end to end."""
    positions = range(step * global_batch, (step + 1) * global_batch)
    perms: dict[int, torch.Tensor] = {}
    out = []
    for p in positions:
        epoch = p // n_windows
        if epoch not in perms:
            perms[epoch] = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(perms[epoch][p % n_windows]))
    return torch.tensor(out, dtype=torch.long)


def lr_factor(step: int, cfg: DistillSpec) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from 1 to ``min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class _Hidden(nn.Module):
    """Forward to the final hidden states and the LM head weight, so the loss chunks the vocabulary.

    The call goes through this module (wrapped in DDP by accelerate) so DDP sees every use of the
    student's parameters. Models whose logits are not a plain bias-free linear map of the last hidden
    state (soft-capping, logit scales) return full logits and no head instead.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        head = model.get_output_embeddings()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.plain = (isinstance(head, nn.Linear) and head.bias is None
                      and getattr(cfg, "final_logit_softcapping", None) is None and getattr(cfg, "logit_scale", None) is None)

    def forward(self, input_ids: torch.Tensor):
        if self.plain:
            hidden = self.model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
            return hidden, self.model.get_output_embeddings().weight
        return self.model(input_ids=input_ids, use_cache=False).logits, None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-2 (the ones predicting a next token), flattened: ``[B·(T−1), D]``."""
    return x[:, :-1].reshape(-1, x.shape[-1])


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step-") and (d / "progress.json").is_file():
            found.append((int(d.name.removeprefix("step-")), d))
    return sorted(found)


def _save(accelerator, root: Path, step: int, cfg: DistillSpec, history: list[StepLog]) -> None:
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record = {"step": step, "settings": cfg.model_dump(mode="json", include=set(TRAJECTORY_KEYS)),
                  "history": [asdict(h) for h in history]}
        (tmp / "progress.json").write_text(json.dumps(record, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # a checkpoint exists only once complete
    accelerator.wait_for_everyone()


def _resume_point(root: Path, cfg: DistillSpec) -> tuple[int, Path | None, list[StepLog]]:
    found = _checkpoints(root)
    if not cfg.resume:
        if found:
            raise CompressError(f"{root} already holds checkpoints (up to step {found[-1][0]}): pass --resume to continue, or delete it")
        return 0, None, []
    if not found:
        raise CompressError(f"--resume: no checkpoint in {root}: run without --resume, or point --checkpoint-dir at the run's checkpoints")
    step, path = found[-1]
    record = json.loads((path / "progress.json").read_text())
    now = cfg.model_dump(mode="json", include=set(TRAJECTORY_KEYS))
    changed = [k for k in TRAJECTORY_KEYS if record["settings"].get(k) != now.get(k)]
    if changed:
        raise CompressError(f"--resume: settings {changed} differ from the checkpointed run's: resume with the same settings")
    return step, path, [StepLog(**h) for h in record["history"]]


def make_accelerator(cfg: DistillSpec, device: str):
    from accelerate import Accelerator

    if cfg.precision is Precision.bf16 and device == "cpu" and not hasattr(torch, "bfloat16"):
        raise CompressError("bf16 is not available here: use precision fp32")
    return Accelerator(cpu=device == "cpu", mixed_precision="bf16" if cfg.precision is Precision.bf16 else "no")


def train(
    accelerator,
    teacher: nn.Module,
    student: nn.Module,
    windows: torch.LongTensor,
    cfg: DistillSpec,
    checkpoint_dir: Path,
    masks: dict[str, torch.Tensor] | None = None,
    on_step: Callable[[StepLog], None] | None = None,
) -> tuple[nn.Module, list[StepLog]]:
    """Distil ``teacher`` into ``student`` for ``cfg.steps`` steps; returns the trained (unwrapped) student and the loss log."""
    masks = masks or {}
    start_step, state_path, history = _resume_point(checkpoint_dir, cfg)
    device = accelerator.device
    teacher.to(device).eval().requires_grad_(False)
    student.train()
    for p in student.parameters():
        p.requires_grad_(True)
    apply_masks(student, masks)
    decay = [p for p in student.parameters() if p.dim() >= 2]
    other = [p for p in student.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    wrapped, optimizer = accelerator.prepare(_Hidden(student), optimizer)
    accelerator.register_for_checkpointing(scheduler)
    teacher_fn = _Hidden(teacher)
    if state_path is not None:
        accelerator.load_state(str(state_path))
        log.info("resumed from %s (step %d)", state_path, start_step)
    processes, rank = accelerator.num_processes, accelerator.process_index
    global_batch = cfg.global_batch(processes)
    tokens_per_step = global_batch * (cfg.seq_len - 1)
    for step in range(start_step, cfg.steps):
        tick = time.perf_counter()
        chosen = batch_windows(len(windows), global_batch, step, cfg.seed)
        sums = torch.zeros(3, device=device)
        for micro in range(cfg.grad_accum):
            part = micro * processes + rank
            ids = windows[chosen[part * cfg.batch_size : (part + 1) * cfg.batch_size]].to(device)
            labels = ids[:, 1:].reshape(-1)
            last = micro == cfg.grad_accum - 1
            with accelerator.autocast():
                with torch.no_grad():
                    t_out, t_head = teacher_fn(ids)
                s_out, s_head = wrapped(ids)
                if cfg.objective is Objective.draft:  # compared at the serving temperature (greedy serving: at 1)
                    parts = draft_loss(_flat(s_out), _flat(t_out), labels, cfg.draft_loss, cfg.draft_temperature or 1.0,
                                       cfg.chunk_tokens, s_head, t_head)
                else:
                    parts = distillation_loss(_flat(s_out), _flat(t_out), labels, cfg.tau, cfg.alpha, cfg.chunk_tokens, s_head, t_head)
            if last:
                accelerator.backward(parts.total / cfg.grad_accum)
            else:
                with accelerator.no_sync(wrapped):
                    accelerator.backward(parts.total / cfg.grad_accum)
            sums += torch.stack([parts.total.detach().float(), parts.kd.float(), parts.ce.float()]) / cfg.grad_accum
        apply_masks(student, masks, grads=True)
        accelerator.clip_grad_norm_(wrapped.parameters(), cfg.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        apply_masks(student, masks)
        total, kd, ce = accelerator.reduce(sums, reduction="mean").tolist()
        entry = StepLog(step + 1, total, kd, ce, lr, tokens_per_step / max(time.perf_counter() - tick, 1e-9))
        history.append(entry)
        if on_step is not None and accelerator.is_main_process:
            on_step(entry)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
            _save(accelerator, checkpoint_dir, step + 1, cfg, history)
    student = accelerator.unwrap_model(wrapped).model
    student.eval()
    student.requires_grad_(False)
    return student, history
