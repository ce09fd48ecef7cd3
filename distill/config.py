"""Typed settings of a distillation run: the recipe's ``distill:`` section and `compress distill`'s options.

Defaults and why:

- ``tau = 2``: Hinton et al. (2015) found intermediate temperatures work best when the student is much
  smaller than the teacher; τ = 2 exposes the teacher's ranking of the plausible next tokens ("dark
  knowledge") without flattening a 4 k-50 k vocabulary into noise, and is the value used by DistilBERT-style
  LM distillation work. Higher τ helps only when the teacher is very confident.
- ``alpha = 0.5``: equal weight on the teacher's soft targets (τ²-scaled, so the weight is independent of
  τ) and on the true next tokens. The hard labels keep the student honest where the teacher is wrong;
  the soft targets carry far more bits per token. 0.5 is the common default (Hinton: "a considerably
  lower weight on the second objective" worked best for them at high τ, i.e. α towards 1 — raise α when
  the teacher is much better than the student's CE fit, e.g. recovering a compressed model).
- ``lr = 5e-4`` with ``warmup_steps = 20`` then cosine decay to 10 %: the student starts from trained
  weights (layers of the teacher or a compressed copy), so a rate ~6× below the reference model's
  pre-training rate fine-tunes without wrecking them.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.distill.loss import DraftLoss


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Objective(str, enum.Enum):
    kd = "kd"  # the teacher's distribution on the training text, α·τ²·KL + (1−α)·CE (Hinton)
    draft = "draft"  # agree with the teacher on sequences it generates itself, by `draft_loss` (DistillSpec)


class Precision(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"  # autocast for the forward passes; weights and optimizer state stay fp32


class StudentSpec(_Strict):
    """Exactly one of: an existing checkpoint; teacher layers to keep; every k-th teacher layer; a config."""

    checkpoint: Path | None = None
    layers: list[int] | None = Field(None, min_length=1, description="teacher decoder layers kept, in order")
    every: int | None = Field(None, ge=1, description="keep teacher layers 0, k, 2k, ...")
    config: dict[str, Any] | None = Field(None, description="teacher config overrides, e.g. hidden_size; random init")
    seed: int = 0

    @model_validator(mode="after")
    def _one_kind(self) -> "StudentSpec":
        given = [k for k in ("checkpoint", "layers", "every", "config") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of checkpoint, layers, every, config (got {', '.join(given) or 'none'})")
        return self

    def describe(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint}"
        if self.layers is not None:
            return f"teacher layers {self.layers}"
        if self.every is not None:
            return f"teacher layers 0, {self.every}, {2 * self.every}, ... (every {self.every})"
        return f"teacher config with {self.config}"


class DistillSpec(_Strict):
    """One distillation run. ``student`` may be omitted after compression stages: the compressed model."""

    data: Path = Field(description="training text (file, folder or saved dataset, as for calibration)")
    student: StudentSpec | None = None
    tau: float = Field(2.0, gt=0)
    alpha: float = Field(0.5, ge=0, le=1)
    steps: int = Field(200, ge=1)
    batch_size: int = Field(8, ge=1, description="windows per process per micro-batch")
    grad_accum: int = Field(1, ge=1)
    seq_len: int = Field(256, ge=2)
    lr: float = Field(5e-4, gt=0)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    precision: Precision = Precision.fp32
    chunk_tokens: int = Field(1024, ge=1, description="tokens per chunk of the vocabulary-wide loss")
    keep_masks: bool = Field(True, description="keep zero weights of sparse (pruned) layers at zero")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps for --resume (0: never); removed once the output is written")
    checkpoint_dir: Path | None = Field(None, description="default: OUTPUT-checkpoints beside the output")
    resume: bool = False
    seed: int = 0
    eval_max_tokens: int | None = Field(None, ge=2, description="ppl before/after on the first N tokens only")
    objective: Objective = Field(Objective.kd, description="kd: the teacher's distribution on the text; draft: on its own generations")
    draft_loss: DraftLoss = Field(DraftLoss.tv, description="draft objective: tv (total variation, 1 − acceptance) or kl (forward KL)")
    draft_temperature: float = Field(1.0, ge=0, description="draft objective: the serving temperature the teacher samples at (0: greedy)")
    draft_prompts: int = Field(256, ge=1, description="draft objective: prompts cut from the data for the teacher to continue")
    draft_prompt_tokens: int = Field(32, ge=1, description="draft objective: tokens per prompt (the rest of seq_len is generated)")
    draft_cache: Path | None = Field(None, description="draft objective: where the teacher's sequences are kept (default: OUTPUT-draft-data)")

    @model_validator(mode="after")
    def _draft_fits(self) -> "DistillSpec":
        if self.objective is Objective.draft and self.draft_prompt_tokens >= self.seq_len:
            raise ValueError(f"draft_prompt_tokens {self.draft_prompt_tokens} leaves nothing to generate in seq_len {self.seq_len}")
        return self

    def global_batch(self, processes: int) -> int:
        return self.batch_size * self.grad_accum * processes
