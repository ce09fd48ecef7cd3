"""AutoRound's learned parameters on our integer grids (`compress.quantizers.autoround`): the differentiable
quantize-dequantize the gradient runs through, and the codes of the chosen parameters.

Shapes: ``w`` and ``V`` ``[out, in]``; ``α`` (on each group's maximum) and ``β`` (on its minimum) ``[out, n_groups]``.
The scale and zero point are `compress.quantizers.grid.compute_qparams`' of the extremes ``(β·min, α·max)``: the
same values, the codes the same rounding (``round(w/s + V)``), so ``V = 0, α = β = 1`` is RTN's grid exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.quantizers.grid import QuantScheme, _grouped
from compress.quantizers.result import QuantResult

V_BOUND = 0.5  # |V| ≤ 0.5: the paper's range (auto-round's step budget, lr·(iters+1)/2, reaches just past it)
SCALE_BOUNDS = (0.0, 1.0)  # α, β: auto-round's ``minmax_scale_bound``


@dataclass
class Params:
    v: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def start(cls, w: torch.Tensor, grid: QuantScheme) -> "Params":
        shape = (w.shape[0], grid.groups(w.shape[1]))
        return cls(torch.zeros_like(w), w.new_ones(shape), w.new_ones(shape))

    def trainable(self, minmax: bool) -> "Params":
        """Fresh leaves with gradients (``α``, ``β`` only when ``minmax``)."""
        return Params(self.v.detach().clone().requires_grad_(), self.alpha.detach().clone().requires_grad_(minmax),
                      self.beta.detach().clone().requires_grad_(minmax))

    def detached(self) -> "Params":
        return Params(self.v.detach(), self.alpha.detach(), self.beta.detach())

    def signed_step(self, lr: float, minmax_lr: float) -> "Params":
        """``p − lr · sign(∂L/∂p)``, each kept in its range; a parameter without a gradient stays."""

        def step(p: torch.Tensor, rate: float, low: float, high: float) -> torch.Tensor:
            if p.grad is None:
                return p.detach()
            return (p.detach() - rate * torch.sign(p.grad)).clamp_(low, high)

        return Params(step(self.v, lr, -V_BOUND, V_BOUND), step(self.alpha, minmax_lr, *SCALE_BOUNDS),
                      step(self.beta, minmax_lr, *SCALE_BOUNDS))


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """``round(x)`` whose gradient is the identity's (exactly ``round(x)``: ``round(x) − x`` is exact)."""
    return x + (torch.round(x) - x).detach()


def _qparams(g: torch.Tensor, p: Params, grid: QuantScheme, ste: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero ``[out, n_groups]`` of grouped ``g`` with the clipping factors: `grid.compute_qparams`' formulas."""
    low, high = g.amin(dim=-1) * p.beta, g.amax(dim=-1) * p.alpha
    top = torch.tensor(float(grid.max_code), dtype=g.dtype, device=g.device)
    if grid.symmetric:
        half = 1 << (grid.bits - 1)
        scale = torch.maximum(-low, high).abs() / (half if grid.full_range else top / 2)
        if grid.full_range:  # signed: the larger clipped extreme onto code −half (auto-round's int_sym)
            scale = torch.where(high >= -low, -scale, scale)
        zero = torch.full_like(scale, float(half)).detach()
    else:
        lo, hi = low.clamp(max=0), high.clamp(min=0)
        scale = (hi - lo) / top
        rounded = round_ste if ste else torch.round
        zero = rounded(-lo / torch.where(scale > 0, scale, 1.0)).clamp(0, grid.max_code)
    return torch.where(scale != 0, scale, torch.ones_like(scale)), zero


def qdq(w: torch.Tensor, p: Params, grid: QuantScheme, start: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized weight ``Q(W)`` ``[out, in]``, differentiable in ``V``, ``α``, ``β`` (straight-through rounding);
    ``start`` (``w``'s shape): the weight rounded on ``w``'s grid in ``w``'s place (GPTQ's start)."""
    g = _grouped(w, grid)
    scale, zero = _qparams(g, p, grid, ste=True)
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    r = round_ste(_grouped(w if start is None else start, grid) / s + _grouped(p.v, grid))
    if grid.symmetric:
        half = 1 << (grid.bits - 1)
        return (r.clamp(-half, grid.max_code - half) * s).reshape(w.shape)
    return (s * ((r + z).clamp(0, grid.max_code) - z)).reshape(w.shape)


def codes_of(w: torch.Tensor, p: Params, grid: QuantScheme,
             start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 scale and zero ``[out, n_groups]`` (`grid.qparams` of the clipped extremes) and int32 codes ``[out, in]``
    (``clamp(round(start/s + V) + z, 0, M)``, ``start`` default ``w``) of the chosen parameters: what
    `grid.dequantize` decodes to `qdq`'s weight."""
    w32 = w.float()
    g = _grouped(w32, grid)
    extremes = (g.amin(dim=-1) * p.beta.float(), g.amax(dim=-1) * p.alpha.float())
    scale, zero = grid.qparams(w32, extremes=extremes)
    rounded = g if start is None else _grouped(start.float(), grid)
    q = torch.round(rounded / scale.unsqueeze(-1) + _grouped(p.v.float(), grid)).add_(zero.unsqueeze(-1))
    return scale, zero, q.clamp_(0, grid.max_code).to(torch.int32).reshape(w.shape)


@dataclass(frozen=True)
class IntRounding:
    """The learned rounding of `compress.quantizers.autoround` on an integer grid: what its core asks of any grid
    (`start`, `qdq`, `finish`; `compress.quantizers.gguf_autoround.GGMLRounding` is the GGML block grids')."""

    scheme: QuantScheme

    def start(self, w: torch.Tensor) -> Params:
        return Params.start(w, self.scheme)

    def qdq(self, w: torch.Tensor, p: Params, start: torch.Tensor | None = None) -> torch.Tensor:
        return qdq(w, p, self.scheme, start)

    def finish(self, w: torch.Tensor, p: Params, start: torch.Tensor | None = None) -> QuantResult:
        """The layer of the chosen parameters: codes, scale, zero and their float32 decode, ``weight_rel_error``."""
        scale, zero, codes = codes_of(w, p, self.scheme, start)
        deq = self.scheme.dequantize(codes, scale, zero)
        rel = float(torch.linalg.vector_norm(w.float() - deq) / torch.linalg.vector_norm(w.float()).clamp_min(1e-30))
        return QuantResult(deq, codes, scale, zero, self.scheme, stats={"weight_rel_error": rel})
