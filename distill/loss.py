"""The knowledge-distillation loss, computed over the vocabulary a chunk of tokens at a time.

Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network" (2015), eq. and §2:

    L = α · τ² · KL(p_teacher,τ ‖ p_student,τ) + (1 − α) · CE(labels, p_student,1)

with ``p_·,τ = softmax(logits / τ)``. The τ² factor keeps the soft term's gradient magnitude
independent of τ (its gradient scales as 1/τ²), so α keeps its meaning when τ changes. Both terms
are means over the tokens that have a label (``labels != ignore_index``).

Shapes. ``student``: logits ``[N, V]``, or final hidden states ``[N, H]`` when ``student_head``
(the LM head weight ``[V, H]``) is given; likewise ``teacher`` / ``teacher_head`` (``H`` may differ).
``labels``: ``[N]`` token ids. ``N`` is tokens (batch × positions, already shifted for next-token
prediction), ``V`` the vocabulary.

Memory. Tokens are processed ``chunk_tokens`` at a time, and each chunk's loss is wrapped in
``torch.utils.checkpoint``: only the chunk's inputs are kept for the backward pass and its
``[chunk, V]`` float32 softmax intermediates are recomputed there. With heads given, the full
``[N, V]`` logits never exist either, so extra memory is O(chunk_tokens · V) whatever N is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from compress.errors import CompressError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossParts:
    """The total loss (differentiable) and its two terms, each a mean over labelled tokens."""

    total: torch.Tensor
    kd: torch.Tensor  # KL(p_teacher,τ ‖ p_student,τ), before the α·τ² weight
    ce: torch.Tensor  # cross-entropy of the student (τ = 1) against the labels
    tokens: int


def _chunk_sums(s, t, labels, s_head, t_head, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed KL(teacher‖student) at temperature τ and summed CE over one chunk of labelled tokens."""
    s_logits = (F.linear(s, s_head) if s_head is not None else s).float()
    with torch.no_grad():
        t_logits = (F.linear(t, t_head) if t_head is not None else t).float()
        t_logp = F.log_softmax(t_logits / tau, dim=-1)
    s_logp = F.log_softmax(s_logits / tau, dim=-1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum()
    ce = F.cross_entropy(s_logits, labels, reduction="sum")
    return kl, ce


def distillation_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    tau: float = 2.0,
    alpha: float = 0.5,
    chunk_tokens: int = 1024,
    student_head: torch.Tensor | None = None,
    teacher_head: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> LossParts:
    """α·τ²·KL(p_t,τ ‖ p_s,τ) + (1−α)·CE, mean over labelled tokens (see the module docstring)."""
    if tau <= 0:
        raise CompressError(f"temperature tau={tau} must be positive: use e.g. tau=2")
    if not 0.0 <= alpha <= 1.0:
        raise CompressError(f"alpha={alpha} must lie in [0, 1]: 1 is distillation only, 0 cross-entropy only")
    if chunk_tokens < 1:
        raise CompressError(f"chunk_tokens={chunk_tokens} must be at least 1")
    if student.dim() != 2 or teacher.dim() != 2 or labels.dim() != 1:
        raise CompressError("distillation_loss takes student/teacher [N, V or H] and labels [N]: flatten batch and positions")
    if not student.shape[0] == teacher.shape[0] == labels.shape[0]:
        raise CompressError(f"token counts differ: student {student.shape[0]}, teacher {teacher.shape[0]}, labels {labels.shape[0]}")
    s_vocab = student_head.shape[0] if student_head is not None else student.shape[1]
    t_vocab = teacher_head.shape[0] if teacher_head is not None else teacher.shape[1]
    if s_vocab != t_vocab:
        raise CompressError(f"student vocabulary {s_vocab} differs from the teacher's {t_vocab}: they must share a tokenizer")
    keep = labels != ignore_index
    n = int(keep.sum())
    if n == 0:
        raise CompressError("no labelled tokens in the batch: every label is ignore_index")
    if not bool(keep.all()):
        student, teacher, labels = student[keep], teacher[keep], labels[keep]
    kl_sum = student.new_zeros((), dtype=torch.float32)
    ce_sum = student.new_zeros((), dtype=torch.float32)
    needs_grad = torch.is_grad_enabled() and (student.requires_grad or (student_head is not None and student_head.requires_grad))
    for lo in range(0, n, chunk_tokens):
        args = (student[lo : lo + chunk_tokens], teacher[lo : lo + chunk_tokens], labels[lo : lo + chunk_tokens],
                student_head, teacher_head, tau)
        if needs_grad:
            kl, ce = checkpoint(_chunk_sums, *args, use_reentrant=False)
        else:
            kl, ce = _chunk_sums(*args)
        kl_sum = kl_sum + kl
        ce_sum = ce_sum + ce
    kd, ce = kl_sum / n, ce_sum / n
    total = alpha * tau * tau * kd + (1.0 - alpha) * ce
    return LossParts(total=total, kd=kd.detach(), ce=ce.detach(), tokens=n)


class DraftLoss(str, enum.Enum):
    """How a draft model's next-token distribution is pulled towards its target's (DistillSpec, Zhou et al.
    2024, arXiv:2310.08461): total variation is exactly 1 − the acceptance rate of speculative sampling."""

    tv = "tv"  # TV(p, q) = ½ Σ |p − q|
    kl = "kl"  # forward KL(p_teacher ‖ q_student)


def _draft_chunk_sums(s, t, labels, s_head, t_head, tau: float, kind: DraftLoss) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed divergence (``kind``, at temperature τ) and summed CE over one chunk of tokens."""
    s_logits = (F.linear(s, s_head) if s_head is not None else s).float()
    with torch.no_grad():
        t_logp = F.log_softmax((F.linear(t, t_head) if t_head is not None else t).float() / tau, dim=-1)
    s_logp = F.log_softmax(s_logits / tau, dim=-1)
    if kind is DraftLoss.tv:
        divergence = 0.5 * (t_logp.exp() - s_logp.exp()).abs().sum()
    else:
        divergence = (t_logp.exp() * (t_logp - s_logp)).sum()
    return divergence, F.cross_entropy(s_logits, labels, reduction="sum")


def draft_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    kind: DraftLoss = DraftLoss.tv,
    tau: float = 1.0,
    chunk_tokens: int = 1024,
    student_head: torch.Tensor | None = None,
    teacher_head: torch.Tensor | None = None,
) -> LossParts:
    """Mean ``kind`` divergence between the teacher's and the student's distributions at temperature τ
    (the whole loss: the labels are the teacher's own samples, so CE is only logged). Shapes as
    `distillation_loss`; ``kd`` holds the divergence."""
    if tau <= 0:
        raise CompressError(f"temperature tau={tau} must be positive")
    if student.dim() != 2 or teacher.dim() != 2 or not student.shape[0] == teacher.shape[0] == labels.shape[0]:
        raise CompressError("draft_loss takes student/teacher [N, V or H] and labels [N] with one N")
    n = labels.shape[0]
    div_sum = student.new_zeros((), dtype=torch.float32)
    ce_sum = student.new_zeros((), dtype=torch.float32)
    needs_grad = torch.is_grad_enabled() and (student.requires_grad or (student_head is not None and student_head.requires_grad))
    for lo in range(0, n, chunk_tokens):
        args = (student[lo : lo + chunk_tokens], teacher[lo : lo + chunk_tokens], labels[lo : lo + chunk_tokens],
                student_head, teacher_head, tau, kind)
        div, ce = checkpoint(_draft_chunk_sums, *args, use_reentrant=False) if needs_grad else _draft_chunk_sums(*args)
        div_sum, ce_sum = div_sum + div, ce_sum + ce
    total = div_sum / n
    return LossParts(total=total, kd=total.detach(), ce=(ce_sum / n).detach(), tokens=n)
