"""Sparsity patterns and the mask helpers every pruner shares.

A pruner scores each weight of ``W [out, in]`` (higher = more important) and removes the lowest
scores within a comparison group:

- `Unstructured(sparsity)`: the ``round(sparsity · in)`` lowest scores of each output row
  (`prune_lowest_per_row`; SparseGPT applies it to a flattened column block instead).
- `NM(n, m)`: N:M semi-structured sparsity, at most ``n`` non-zeros in every group of ``m``
  consecutive input columns of a row: the ``m − n`` lowest scores of each group (`prune_lowest_nm`).

Masks are boolean tensors of the weight's shape, True where a weight is pruned (set to zero).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

import torch


@dataclass(frozen=True)
class Unstructured:
    """Prune a fraction ``sparsity`` of the weights, compared within each row."""

    sparsity: float

    def __post_init__(self) -> None:
        if not 0 <= self.sparsity < 1:
            raise ValueError(f"sparsity must be in [0, 1), got {self.sparsity}")


@dataclass(frozen=True)
class NM:
    """Keep at most ``n`` of every ``m`` consecutive input columns (2:4, 4:8)."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not 0 < self.n < self.m:
            raise ValueError(f"N:M pattern needs 0 < N < M, got {self.n}:{self.m}")

    @property
    def sparsity(self) -> float:
        return 1 - self.n / self.m

    @classmethod
    def parse(cls, text: str) -> "NM":
        """``"2:4"`` → ``NM(2, 4)``; raises ValueError on anything else."""
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
        if not match:
            raise ValueError(f"pattern {text!r} is not N:M")
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


Pattern = Union[Unstructured, NM]


def prune_lowest_per_row(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Mask of the ``round(sparsity · in)`` lowest scores in each row of ``scores [out, in]``."""
    k = int(round(sparsity * scores.shape[1]))
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k:
        mask.scatter_(1, torch.topk(scores, k, dim=1, largest=False).indices, True)
    return mask


def prune_lowest_nm(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Mask of the ``m − n`` lowest scores in each group of ``m`` consecutive columns of ``scores [out, in]``."""
    out_features, in_features = scores.shape
    if in_features % m:
        raise ValueError(f"N:M group size {m} does not divide in_features {in_features}")
    grouped = scores.reshape(out_features, in_features // m, m)
    mask = torch.zeros_like(grouped, dtype=torch.bool)
    mask.scatter_(2, torch.topk(grouped, m - n, dim=2, largest=False).indices, True)
    return mask.reshape(out_features, in_features)


def prune_lowest(scores: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """Mask of the lowest scores of ``scores [out, in]`` under ``pattern``, per row or per N:M group."""
    if isinstance(pattern, NM):
        return prune_lowest_nm(scores, pattern.n, pattern.m)
    return prune_lowest_per_row(scores, pattern.sparsity)


def is_nm_sparse(weight: torch.Tensor, n: int, m: int) -> bool:
    """True when every group of ``m`` consecutive input columns of ``weight [out, in]`` has ≤ ``n`` non-zeros."""
    out_features, in_features = weight.shape
    if in_features % m:
        return False
    nonzero = (weight != 0).reshape(out_features, in_features // m, m).sum(dim=2)
    return bool((nonzero <= n).all())
