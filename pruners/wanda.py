"""Wanda: pruning by weights and activations, with no weight update.

Sun, Liu, Bair, Kolter, "A Simple and Effective Pruning Approach for Large Language Models",
ICLR 2024, arXiv:2306.11695.

Objective. Remove the weights whose removal changes the layer output least to first order, scored by

    S_ij = |W_ij| · ‖X_j‖₂,

where ``‖X_j‖₂`` is the L2 norm of input feature ``j`` over all calibration tokens. Scores are
compared within each output row (the paper's "per output" comparison group) for unstructured
sparsity, and within each group of M consecutive input columns for N:M. The kept weights are not changed.

Shapes: ``weight [out, in]``, ``input_l2 [in]`` (``Stat.INPUT_L2``) → ``PruneResult`` with
``weight``/``pruned [out, in]`` (float32; the inputs are not modified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.pruners.masks import Pattern, prune_lowest
from compress.pruners.result import PruneResult


@dataclass(frozen=True)
class WandaConfig:
    pattern: Pattern  # Unstructured(sparsity) or NM(n, m)


def wanda(weight: torch.Tensor, input_l2: torch.Tensor, config: WandaConfig) -> PruneResult:
    """Prune ``weight [out, in]`` by ``|W| · ‖X_j‖₂`` given the input norms ``input_l2 [in]``."""
    if weight.dim() != 2 or input_l2.shape != (weight.shape[1],):
        raise ValueError(f"weight {tuple(weight.shape)} and input_l2 {tuple(input_l2.shape)} do not match")
    w = weight.detach().float()
    norms = input_l2.detach().float().to(w.device)
    if not torch.isfinite(norms).all():
        raise ValueError("input_l2 contains NaN or inf")
    pruned = prune_lowest(w.abs() * norms.unsqueeze(0), config.pattern)
    new = torch.where(pruned, torch.zeros_like(w), w)
    return PruneResult(new, pruned, stats={"sparsity": float((new == 0).float().mean())})
