"""AWQ: activation-aware weight quantization (Lin et al. 2023, arXiv:2306.00978).

A few input channels matter far more than the rest because their activations are large. AWQ protects
them without mixed precision: scale input channel ``j`` of the weights by ``s_j`` before quantizing and
divide the activations by ``s_j`` (folded into the preceding operator), so ``Q(W·diag(s))·diag(s)⁻¹x``
approximates ``Wx`` with a smaller relative error on the salient channels.

1. Scales (paper §3.2): ``s = s_x^α`` with ``s_x`` the mean absolute activation per input channel
   (``[in]``), normalized by ``sqrt(max(s)·min(s))``; optionally the "duo" form of AutoAWQ,
   ``s_x^α / s_w^(1−α)`` with ``s_w`` the mean of the group-normalized ``|W|`` per column. ``α`` is
   searched on ``n_grid`` points in ``[0, 1)`` minimizing the output error of the sub-block the layers
   feed, measured by a caller-supplied ``loss(weights)`` on the layers' candidate (fake-quantized,
   unscaled) weights. ``α = 0`` is plain round-to-nearest, so the search never loses to it.
2. Clipping (AutoAWQ's ``auto_clip``): per (row, group), shrink the range to ``1 − i/n_grid`` of its
   min-max for ``i < max_shrink·n_grid``, keeping the shrink with the smallest error of the group's
   partial output ``Σ_k x_k w_k`` over sample tokens ``x [n_tokens, in]``.
3. Quantize with the shared grid at that range (`compress.quantizers.rtn.rtn` with ``shrink``).

Any `Grid` serves: the integer grid, or a float grid (FP8 per channel, NVFP4, MXFP4: AWQ for FP4 as
llm-compressor runs it). NVFP4's per-tensor global scale is refitted on each candidate (scaled) weight,
as it is when the layer is finally quantized; the clipping shrinks each E4M3/E8M0 group scale.

Shapes: weights ``[out, in]``; ``x_mean`` ``[in]``; returned scales ``[in]``, shrink ``[out, n_groups]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from compress.quantizers.result import Grid


@dataclass(frozen=True)
class AWQConfig:
    scheme: Grid
    n_grid: int = 20  # α candidates: 0, 1/n, ..., (n-1)/n
    duo_scaling: bool = False
    clip_grid: int = 20
    max_shrink: float = 0.5  # the clipping search narrows ranges down to (1 - max_shrink)


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # [in], to multiply the weights' columns by (and divide the inputs by)
    alpha: float
    loss: float  # at the chosen α
    rtn_loss: float  # at α = 0 (plain round-to-nearest)
    losses: list[float] = field(default_factory=list)


def round_trip(w: torch.Tensor, scheme: Grid, shrink: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``w`` rounded to ``scheme`` (its per-tensor parameters fitted on ``w``), as float32."""
    fitted = scheme.fit(w)
    scale, zero = fitted.qparams(w, shrink)
    return fitted.dequantize(fitted.quantize(w, scale, zero), scale, zero)


def _column_salience(weights: list[torch.Tensor], scheme: Grid) -> torch.Tensor:
    """Mean over output rows of ``|w|`` normalized by its group's max: ``[in]``."""
    w = torch.cat([x.float() for x in weights]).abs()
    out_features, in_features = w.shape
    g = w.reshape(out_features, -1, scheme.group_width(in_features))
    g = g / g.amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return g.reshape(out_features, in_features).mean(dim=0)


def candidate_scales(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    x = x_mean.float().clamp(min=1e-12)
    scales = x.pow(alpha) if w_mean is None else x.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)
    scales = scales.clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


def search_scales(
    x_mean: torch.Tensor,
    weights: list[torch.Tensor],
    loss: Callable[[list[torch.Tensor]], float],
    config: AWQConfig,
    quantizers: list[Callable[[torch.Tensor], torch.Tensor] | None] | None = None,
) -> ScaleSearch:
    """Search ``α``; ``loss`` receives each layer's ``Q(W·s)/s`` and returns the output error.

    ``Q`` is the shared grid of ``config.scheme`` unless ``quantizers`` gives a layer its own round trip
    (``w -> dequantize(quantize(w))``, e.g. a GGUF block type)."""
    w_mean = _column_salience(weights, config.scheme) if config.duo_scaling else None
    default = lambda w: round_trip(w.float(), config.scheme)  # noqa: E731
    quantizers = [q or default for q in (quantizers or [None] * len(weights))]
    best = None
    losses = []
    for i in range(config.n_grid):
        alpha = i / config.n_grid
        scales = candidate_scales(x_mean, alpha, w_mean)
        candidates = [quant(w.float() * scales) / scales for w, quant in zip(weights, quantizers)]
        value = float(loss(candidates))
        losses.append(value)
        if best is None or value < best[0]:
            best = (value, alpha, scales)
    value, alpha, scales = best
    return ScaleSearch(scales, alpha, value, losses[0], losses)


def search_clip(weight: torch.Tensor, x: torch.Tensor, config: AWQConfig, rows_per_batch: int = 1024) -> torch.Tensor:
    """Per (row, group) range shrink minimizing the group's partial-output error on tokens ``x [n, in]``,
    ``mean_n (Σ_k x_nk δ_k)²`` with ``δ`` the group's weight change. Groups narrower than ``n`` take it as
    ``δ G_g δᵀ / n`` from the Gram matrices ``G_g = Σ_n x_ng x_ngᵀ`` ``[G, width, width]``: ``width²`` products
    per (row, group) instead of ``n·width`` (8× fewer on 512 tokens and groups of 64); wider ones (per channel)
    from the partial outputs ``x·δ``. A candidate that rounds to the same codes gets the very same error."""
    w = weight.float()
    scheme = config.scheme.fit(w)  # per-tensor parameters (NVFP4's global scale) from the whole weight
    out_features, in_features = w.shape
    width = scheme.group_width(in_features)
    xg = x.float().reshape(-1, in_features // width, width).transpose(0, 1)  # [G, n, width]
    tokens = max(xg.shape[1], 1)
    gram = xg.transpose(1, 2) @ xg if width < tokens else None  # [G, width, width]
    steps = [1 - i / config.clip_grid for i in range(int(config.max_shrink * config.clip_grid))]
    best_shrink = torch.ones(out_features, in_features // width, device=w.device)
    for start in range(0, out_features, rows_per_batch):  # bounds the [G, rows, width] products
        rows = w[start : start + rows_per_batch]
        best_err = None
        for shrink in steps:
            scale, zero = scheme.qparams(rows, shrink)
            deq = scheme.dequantize(scheme.quantize(rows, scale, zero), scale, zero)
            delta = (deq - rows).reshape(rows.shape[0], -1, width).transpose(0, 1)  # [G, rows, width]
            if gram is not None:
                err = ((delta @ gram).mul_(delta).sum(dim=-1) / tokens).T  # [rows, G]
            else:
                err = (xg @ delta.transpose(1, 2)).square_().mean(dim=1).T  # [G, n, rows] -> [rows, G]
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_shrink[start : start + rows_per_batch][better] = shrink
    return best_shrink
