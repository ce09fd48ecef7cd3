"""The one statistics module: what calibration inputs tell each method about a layer's input.

Every method declares the `Stat` kinds it needs; the engine attaches a `StatsCollector` to a block's
layers and collects exactly those, from the layer inputs ``x`` (``[..., in_features]``: 2-D or 3-D
activations, nn.Linear and GPT-2 Conv1D alike). All accumulation is float32 (the Hessian and mean as
running means, the L2 norm as a sum of squares), so the figures do not depend on how calibration
samples are batched.

- HESSIAN: ``H = 2/n Σ x xᵀ`` over all n token vectors (``[in, in]``), the GPTQ/SparseGPT proxy Hessian.
- INPUT_L2: per-input-channel L2 norm ``‖X_j‖₂`` over all tokens (``[in]``), Wanda's activation norm.
- INPUT_ABSMAX: per-input-channel ``max |X_j|`` (``[in]``), SmoothQuant's activation range.
- INPUT_ABSMEAN: per-input-channel ``mean |X_j|`` (``[in]``), AWQ's activation salience.
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager

import torch
from torch import nn


class Stat(enum.Enum):
    HESSIAN = "hessian"
    INPUT_L2 = "input_l2"
    INPUT_ABSMAX = "input_absmax"
    INPUT_ABSMEAN = "input_absmean"


class InputStatistics:
    """Running statistics of one layer's inputs."""

    def __init__(self, in_features: int, needs: frozenset[Stat], device: torch.device | str = "cpu"):
        self.in_features = in_features
        self.needs = needs
        self.count = 0  # token vectors seen
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=device)  # noqa: E731
        self.hessian = zeros(in_features, in_features) if Stat.HESSIAN in needs else None
        self.sq_sum = zeros(in_features) if Stat.INPUT_L2 in needs else None
        self.absmax = zeros(in_features) if Stat.INPUT_ABSMAX in needs else None
        self.absmean = zeros(in_features) if Stat.INPUT_ABSMEAN in needs else None

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.in_features).float()
        m = x.shape[0]
        if m == 0:
            return
        n = self.count
        total = n + m
        if self.hessian is not None:
            # Running mean of 2 x xᵀ: rescale the old mean, add the new rows scaled by sqrt(2/total).
            self.hessian.mul_(n / total)
            xs = x * (2.0 / total) ** 0.5
            self.hessian.addmm_(xs.t(), xs)
        if self.sq_sum is not None:
            self.sq_sum.add_(x.square().sum(dim=0))
        if self.absmax is not None:
            torch.maximum(self.absmax, x.abs().amax(dim=0), out=self.absmax)
        if self.absmean is not None:
            self.absmean.mul_(n / total).add_(x.abs().sum(dim=0) / total)
        self.count = total

    def result(self) -> dict[Stat, torch.Tensor]:
        out: dict[Stat, torch.Tensor] = {}
        if self.hessian is not None:
            out[Stat.HESSIAN] = self.hessian
        if self.sq_sum is not None:
            out[Stat.INPUT_L2] = self.sq_sum.sqrt()
        if self.absmax is not None:
            out[Stat.INPUT_ABSMAX] = self.absmax
        if self.absmean is not None:
            out[Stat.INPUT_ABSMEAN] = self.absmean
        return out


def layer_in_features(module: nn.Module) -> int:
    """Input width of a Linear (``in_features``) or GPT-2 Conv1D (``weight [in, out]``)."""
    in_features = getattr(module, "in_features", None)
    if in_features is None:  # transformers' Conv1D stores weight as [in, out]
        in_features = module.weight.shape[0]
    return int(in_features)


def _feeder(stats: InputStatistics):
    def hook(_module, args, kwargs):
        stats.update(args[0] if args else next(iter(kwargs.values())))

    return hook


class StatsCollector(AbstractContextManager):
    """Forward pre-hooks that feed each layer's input into its `InputStatistics`."""

    def __init__(self, layers: dict[str, nn.Module], needs: frozenset[Stat]):
        self.needs = needs
        self.stats = {
            name: InputStatistics(layer_in_features(m), needs, m.weight.device) for name, m in layers.items()
        }
        self._layers = layers
        self._handles: list = []

    def __enter__(self) -> "StatsCollector":
        if self.needs:
            for name, module in self._layers.items():
                stats = self.stats[name]
                self._handles.append(module.register_forward_pre_hook(_feeder(stats), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def results(self) -> dict[str, dict[Stat, torch.Tensor]]:
        return {name: s.result() for name, s in self.stats.items()}


class CallRecorder(AbstractContextManager):
    """Records every call of some modules during a forward pass: positional and keyword inputs, and
    the first output (methods that re-run a sub-module under candidate weights, like AWQ, replay these).

    Tensors are kept as they were passed (no copies): the caller owns the recording's memory.
    """

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self.calls: dict[str, list[tuple[tuple, dict, torch.Tensor]]] = {name: [] for name in modules}
        self._handles: list = []

    def __enter__(self) -> "CallRecorder":
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def _hook(self, name: str):
        def hook(_module, args, kwargs, output):
            first = output[0] if isinstance(output, (tuple, list)) else output
            self.calls[name].append((args, dict(kwargs), first))

        return hook

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
