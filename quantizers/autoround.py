"""AutoRound: learned rounding and clipping by signed gradient descent, one decoder block at a time.

Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the Quantization of LLMs"
(arXiv 2309.05516), as Intel's ``auto-round`` runs it. Each weight ``W [out, in]`` of a block gets a
rounding offset ``V`` (``W``'s shape, init 0, kept in [−0.5, 0.5]) and each (row, group) clipping factors
``α`` on its maximum and ``β`` on its minimum (``[out, n_groups]``, init 1, kept in [0, 1]). On an
asymmetric grid of ``M = 2**bits − 1`` codes

    s = (α·max(w, 0) − β·min(w, 0)) / M,   z = round(−β·min(w, 0) / s)
    Q(W) = s · (clamp(⌊W/s + V⌉ + z, 0, M) − z)

and on a symmetric one ``s = max(α·max(w, 0), −β·min(w, 0)) / (M/2)``, ``Q(W) = s · clamp(⌊W/s + V⌉, −2**(b−1),
2**(b−1) − 1)``, with ``s`` signed and divided by ``2**(b−1)`` on a full-range one (auto-round's ``int_sym``)
(`compress.quantizers.grid`'s grids: at ``V = 0, α = β = 1`` each is RTN's). Rounding passes
gradients straight through. Objective, over the calibration samples ``x`` of a step:

    min_{V, α, β}  mean ‖f(Q(W); x) − y‖²

with ``f`` the block (the caller's differentiable ``forward``) and ``y`` its float outputs (the caller's
``targets``). Update, SignSGD with a learning rate decayed linearly to 0 over ``iters`` steps:

    p ← p − lr · (1 − t/iters) · sign(∂L/∂p),   lr = 1/iters (V; α and β: ``minmax_lr``, default lr)

Each step takes a mini-batch of ``batch_size`` samples from a shuffled order (reshuffled, the rest dropped, when
fewer remain: auto-round's ``IndexSampler``) and keeps the parameters of the step with the lowest loss (``best``,
auto-round's default; else the last step's). ``sign(0) = 0``: a parameter with no gradient stays. The mini-batch's
loss is the mean over its samples' elements, as auto-round's one batch takes it, but each sample runs through ``f``
on its own (``forward`` takes one sample) and the samples' gradients with respect to the quantized weights
are summed in float64, in the order of the step: the same sum on any split of the samples, so processes that each
hold some of them (``inputs[i] is None`` for a sample held elsewhere) take the very step of one process once
``reduce`` has summed their float64 parts (an all-reduce; one process: nothing to do).

Start (``starts``, ours; auto-round starts at RTN): a weight ``W₀`` rounded in ``W``'s place on ``W``'s grid,
``Q(W) = s · (clamp(⌊W₀/s + V⌉ + z, 0, M) − z)`` with ``s``, ``z`` as above. With ``W₀`` GPTQ's dequantized weight on
that same grid (static groups of min-max scales: act-order GPTQ without a clipping search), ``V = 0, α = β = 1`` is
GPTQ's rounding exactly: the steps start from GPTQ's codes instead of RTN's.

Grids: an integer `QuantScheme` (`compress.quantizers.autoround_grid.IntRounding`, the formulas above) or any object
with the same three methods, ``start(w) -> Params``, ``qdq(w, p, start)`` (differentiable) and ``finish(w, p, start)``
(the layer of the chosen parameters): GGML's block grids, `compress.quantizers.gguf_autoround.GGMLRounding`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from compress.quantizers.autoround_grid import IntRounding, Params
from compress.quantizers.grid import QuantScheme
from compress.quantizers.result import QuantResult


@dataclass(frozen=True)
class AutoRoundConfig:
    iters: int = 200
    lr: float | None = None  # None: 1 / iters
    minmax_lr: float | None = None  # None: lr
    batch_size: int = 8  # samples per step (all of them where fewer)
    minmax_tuning: bool = True  # learn α and β (else only V)
    best: bool = True  # keep the step with the lowest loss (auto-round's default; its not_use_best_mse is False)
    seed: int = 0  # the sample order

    def rates(self) -> tuple[float, float]:
        lr = self.lr if self.lr is not None else 1.0 / max(self.iters, 1)
        return lr, self.minmax_lr if self.minmax_lr is not None else lr


@dataclass
class AutoRoundResult:
    """``layers``: each weight's codes and dequantized weight (`QuantResult`, float32); ``params``: the chosen
    ``V``, ``α``, ``β`` by weight; ``losses``: each step's loss (before its update); ``best_step``: the step whose
    parameters were kept (-1: none ran, RTN)."""

    layers: dict[str, QuantResult | Any]  # a non-integer grid's: what its ``finish`` returns
    params: dict[str, Params]
    losses: list[float] = field(default_factory=list)
    best_step: int = -1

    @property
    def stats(self) -> dict[str, Any]:
        first = self.losses[0] if self.losses else None
        chosen = self.losses[self.best_step] if self.losses else None
        return {"loss_first": first, "loss_best": chosen, "best_step": self.best_step}


def _order(n: int, batch: int, seed: int):
    """Batches of ``batch`` indices from a shuffled order of ``n``, reshuffled when fewer than ``batch`` remain."""
    generator = torch.Generator().manual_seed(seed)
    order, at = torch.randperm(n, generator=generator).tolist(), 0
    while True:
        if at + batch > n:
            order, at = torch.randperm(n, generator=generator).tolist(), 0
        yield order[at : at + batch]
        at += batch


_LOSS = ""  # the loss's key among the float64 sums (no weight is named "")


def _sample_gradients(forward, leaves: dict[str, torch.Tensor], samples: list, count: int) -> dict[str, torch.Tensor]:
    """The float64 sums, over ``samples`` (``(input, target)`` pairs, each run through ``forward`` on its own), of the
    mini-batch loss's gradient with respect to each of ``leaves`` and of the loss itself (key `_LOSS`); ``count``: the
    mini-batch's samples on every process, each sample's error weighing 1/count of the mean."""
    sums = {n: torch.zeros(leaf.shape, dtype=torch.float64, device=leaf.device) for n, leaf in leaves.items()}
    sums[_LOSS] = torch.zeros((), dtype=torch.float64, device=next(iter(leaves.values())).device)
    for x, target in samples:
        dtype = torch.promote_types(target.dtype, torch.float32)  # the error in float32 at least
        error = (forward(leaves, x).to(dtype) - target.to(dtype)).square().mean() / count
        error.backward()
        sums[_LOSS] += error.detach().double()
        for n, leaf in leaves.items():
            if leaf.grad is not None:  # a weight the forward did not reach has no gradient
                sums[n] += leaf.grad.double()
                leaf.grad = None
    return sums


def autoround(
    forward: Callable[[dict[str, torch.Tensor], Any], torch.Tensor],
    weights: dict[str, torch.Tensor],
    inputs: list,
    targets: list[torch.Tensor],
    config: AutoRoundConfig,
    grids: dict[str, QuantScheme | Any],
    starts: dict[str, torch.Tensor] | None = None,
    reduce: Callable[[list[torch.Tensor]], None] = lambda parts: None,
) -> AutoRoundResult:
    """Learn ``V``, ``α``, ``β`` for ``weights`` (name → ``[out, in]``; not modified) so that ``forward(Q(weights),
    inputs[i])`` matches ``targets[i]`` over every mini-batch of samples; ``grids``: each weight's grid (an integer
    `QuantScheme`, or a rounding object as the module says). Parameters take the weights' dtype (float32 at least);
    ``forward`` must be differentiable in the weights it is given. ``starts``: the weights rounded in ``weights``' place, by name
    (those not named: their own weight). ``inputs``/``targets``: one per sample, over every process; a sample another
    process holds is None here. ``reduce``: sums float64 tensors over the processes, in place."""
    ws = {n: w.detach() if w.dtype == torch.float64 else w.detach().float() for n, w in weights.items()}
    w0 = {n: ((starts or {}).get(n, w)).detach().to(w.dtype) for n, w in ws.items()}
    rounding = {n: IntRounding(g) if isinstance(g, QuantScheme) else g for n, g in grids.items()}
    params = {n: rounding[n].start(w) for n, w in ws.items()}
    lr, minmax_lr = config.rates()
    losses: list[float] = []
    chosen, best_step = params, -1
    batches = _order(len(inputs), min(config.batch_size, len(inputs)), config.seed) if config.iters > 0 else None
    for step in range(config.iters):
        current = {n: p.trainable(config.minmax_tuning) for n, p in params.items()}
        picked = next(batches)
        with torch.enable_grad():
            quantized = {n: rounding[n].qdq(ws[n], current[n], w0[n]) for n in ws}
            leaves = {n: q.detach().requires_grad_() for n, q in quantized.items()}  # the block's graph, apart from qdq's
            sums = _sample_gradients(forward, leaves, [(inputs[i], targets[i]) for i in picked if inputs[i] is not None],
                                     len(picked))
            reduce(list(sums.values()))
            loss = float(sums.pop(_LOSS))
            torch.autograd.backward(list(quantized.values()), [sums[n].to(quantized[n].dtype) for n in quantized])
        losses.append(loss)
        if not config.best or loss < (losses[best_step] if best_step >= 0 else float("inf")):
            chosen, best_step = {n: p.detached() for n, p in current.items()}, step
        decay = 1.0 - step / config.iters
        params = {n: p.signed_step(lr * decay, minmax_lr * decay) for n, p in current.items()}
    with torch.no_grad():
        layers = {n: rounding[n].finish(w, chosen[n], w0[n]) for n, w in ws.items()}
    return AutoRoundResult(layers, chosen, losses, best_step)


def autoround_linear(weight: torch.Tensor, inputs: list[torch.Tensor], config: AutoRoundConfig,
                     grid: QuantScheme) -> AutoRoundResult:
    """One linear layer ``y = x Wᵀ`` (``weight [out, in]``, each input ``[..., in]``), fitted to its float outputs."""
    targets = [x.to(weight.dtype) @ weight.detach().T for x in inputs]
    return autoround(lambda ws, x: x.to(ws["weight"].dtype) @ ws["weight"].T, {"weight": weight}, inputs, targets,
                     config, {"weight": grid})
