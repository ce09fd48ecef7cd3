"""SmoothQuant's smoothing scales (Xiao et al. 2022, arXiv:2211.10438, §4).

Activation outliers make per-token int8 activations coarse, while weights are easy to quantize.
SmoothQuant migrates the difficulty: divide input channel ``j`` of the activations by ``s_j`` and
multiply the weights' column ``j`` by it (the division folded into the preceding norm), with

    s_j = max|X_j|^α / max|W_j|^(1−α)

where ``max|X_j|`` is the calibrated per-channel activation range (``[in]``) and ``max|W_j|`` the
largest weight magnitude of column ``j`` across every linear layer reading that activation
(``[out_i, in]`` each). ``α = 0.5`` balances the two ranges; larger ``α`` moves more difficulty into
the weights. Both ranges are clamped at 1e-5 as in the authors' code, so dead channels stay finite.
"""

from __future__ import annotations

import torch

EPS = 1e-5


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """Per-input-channel smoothing factors ``s [in]``: activations are divided by them, weights multiplied."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    w_max = torch.cat([w.detach().float().abs() for w in weights]).amax(dim=0).clamp(min=EPS)
    a_max = act_absmax.float().clamp(min=EPS)
    return (a_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=EPS)
