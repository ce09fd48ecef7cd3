"""Magnitude pruning: the data-free baseline every calibrated pruner is measured against.

Score ``|W_ij|``; remove the lowest scores within each output row (unstructured, as Wanda compares)
or within each group of M consecutive input columns (N:M). Objective: none beyond keeping the
largest weights. Shapes: ``weight [out, in]`` → ``PruneResult`` with ``weight``/``pruned [out, in]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.pruners.masks import Pattern, prune_lowest
from compress.pruners.result import PruneResult


@dataclass(frozen=True)
class MagnitudeConfig:
    pattern: Pattern  # Unstructured(sparsity) or NM(n, m)


def magnitude(weight: torch.Tensor, config: MagnitudeConfig) -> PruneResult:
    """Zero the smallest-magnitude weights of ``weight [out, in]``. Does not modify ``weight``."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got {tuple(weight.shape)}")
    w = weight.detach().float()
    pruned = prune_lowest(w.abs(), config.pattern)
    new = torch.where(pruned, torch.zeros_like(w), w)
    return PruneResult(new, pruned, stats={"sparsity": float((new == 0).float().mean())})
