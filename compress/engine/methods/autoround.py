"""AutoRound as an engine method: each decoder block's selected layers learn their rounding and clipping together
(`compress.quantizers.autoround`), the block run with the differentiable quantized weights swapped in
(`torch.func.functional_call`: the block itself is not changed until the chosen weights are set).

Inputs and targets, as auto-round takes them: the block's calibration windows as the compressed model feeds them
(``enable_quanted_input``; else the uncompressed model's), fitted to the uncompressed block's outputs on the
uncompressed model's inputs (`compress.engine.reference`, which `Method.block_inputs` asks the engine to carry).
One window is one sample; each step's ``batch_size`` windows run through the block one at a time, their gradients
summed in float64 (`compress.quantizers.autoround`). Under a launcher each process runs the windows it holds and
the sums are all-reduced, so every process takes one process's steps and keeps its bytes. ``init=gptq`` starts the
rounding at GPTQ's (act order, min-max static groups: RTN's grid) on each layer's Hessian of the block's inputs,
which the method then asks the engine for.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field, TypeAdapter, model_validator
from torch.func import functional_call

from compress.checkpoints.model_io import get_weight, is_conv1d, set_weight
from compress.engine.methods.base import LayerOutcome, LayerReport, Method
from compress.engine.methods.rtn import WeightQuantConfig, check_group_size
from compress.engine.one_pass import windows_of
from compress.engine.passes import block_output
from compress.engine.registry import register_method
from compress.engine.statistics import Stat
from compress.errors import CompressError
from compress.quantizers.autoround import AutoRoundConfig, autoround
from compress.quantizers.gptq import GPTQConfig, gptq

if TYPE_CHECKING:
    from compress.engine.ranks import Ranks


class Start(str, enum.Enum):
    RTN = "rtn"
    GPTQ = "gptq"


class AutoRoundMethodConfig(WeightQuantConfig):
    """auto-round's names for its settings."""

    iters: int = Field(200, ge=0, description="signed-gradient steps per block (0: round to nearest)")
    lr: float | None = Field(None, gt=0, description="step size of the rounding offsets, decayed linearly to 0 (default 1/iters)")
    minmax_lr: float | None = Field(None, gt=0, description="step size of the min/max clipping factors (default lr)")
    batch_size: int = Field(8, ge=1, description="calibration windows per step")
    enable_minmax_tuning: bool = Field(True, description="learn each group's min/max clipping factors beside the rounding")
    enable_quanted_input: bool = Field(True, description="fit each block on the compressed model's inputs (else the uncompressed model's)")
    not_use_best_mse: bool = Field(False, description="keep the last step's parameters instead of the lowest-loss step's")
    seed: int = Field(0, description="order of the calibration windows over the steps")
    init: Start = Field(Start.RTN, description="rounding the steps start from: rtn (auto-round's) or gptq (act-order GPTQ "
                                               "on RTN's grid, from each layer's Hessian)")
    damp: float = Field(0.01, gt=0, description="with init=gptq: GPTQ's damping, λ = damp · mean(diag H)")
    full_range: bool = Field(True, description="symmetric grid whose step is max|w| / 2**(bits-1), each group's extreme on "
                                               "the lowest code (auto-round's int_sym; an asymmetric grid ignores the default)")

    @model_validator(mode="before")
    @classmethod
    def _full_range_where_symmetric(cls, data: Any) -> Any:
        """The full range is auto-round's symmetric grid, so it is the default there; asked for asymmetric, the grid
        is asymmetric (a full range given with it stays an error)."""
        if isinstance(data, dict) and "full_range" not in data and not TypeAdapter(bool).validate_python(data.get("symmetric", True)):
            data = {**data, "full_range": False}
        return data

    def core(self) -> AutoRoundConfig:
        return AutoRoundConfig(self.iters, self.lr, self.minmax_lr, self.batch_size, self.enable_minmax_tuning,
                               not self.not_use_best_mse, self.seed)


def _windows(batches) -> list:
    """One ``(hidden, args, kwargs)`` call per calibration window, cut from the batches (`one_pass.windows_of`)."""
    calls = []
    for batch in batches:
        count = batch[0].shape[0]
        calls += [windows_of(tuple(batch), count, slice(i, i + 1)) for i in range(count)] if count > 1 else [tuple(batch)]
    return calls


def _everyones(ranks: Ranks, held: list) -> list:
    """Every process's windows in one list, in the order one process holds them (ranks hold contiguous shares, in
    rank order: `Ranks.local_share`), those of other processes None."""
    counts = [int(c) for c in ranks.gather(len(held))]
    before = sum(counts[: ranks.rank])
    return [None] * before + held + [None] * (sum(counts) - before - len(held))


def _summing(ranks: Ranks):
    """The core's ``reduce``: float64 tensors summed over the processes in one all-reduce (one process: nothing)."""
    def reduce(parts: list[torch.Tensor]) -> None:
        if ranks.world == 1:
            return
        flat = ranks.sum_(torch.cat([p.reshape(-1) for p in parts]))
        for part, summed in zip(parts, flat.split([p.numel() for p in parts])):
            part.copy_(summed.view_as(part))
    return reduce


def _graph_ready(value):
    """``value`` with its inference-mode tensors copied (the engine's passes make them; autograd cannot save them)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_graph_ready(v) for v in value)
    if isinstance(value, dict):
        return {k: _graph_ready(v) for k, v in value.items()}
    return value


@register_method("autoround")
class AutoRound(Method):
    """Learn each weight's rounding offset and each group's clipping by signed gradient descent on the block's output."""

    Config = AutoRoundMethodConfig

    @property
    def block_inputs(self) -> bool:
        return True

    @property
    def needs(self) -> frozenset[Stat]:
        return frozenset({Stat.HESSIAN}) if self.config.init is Start.GPTQ else frozenset()

    def _gptq_starts(self, selected: dict[str, str], weights: dict, grids: dict, stats) -> dict[str, torch.Tensor]:
        """Each layer's act-order GPTQ weight on RTN's grid (relative name -> dequantized ``[out, in]``)."""
        starts = {}
        for rel, full in selected.items():
            # GPTQ's codes on RTN's grid: the steps round on that grid, so its scales are not refitted
            config = GPTQConfig(grids[rel], damp=self.config.damp, act_order=True, mse=False, refit_scales=False)
            try:
                starts[rel] = gptq(weights[rel], stats[full][Stat.HESSIAN], config).weight
            except ValueError as exc:
                raise CompressError(f"autoround's GPTQ start failed on {full}: {exc}") from None
        return starts

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        check_group_size(name, in_features, self.config.group_size)

    def grids(self, selected: dict[str, str], weights: dict, stats) -> dict:
        """Each selected layer's grid (relative name -> what `compress.quantizers.autoround.autoround` rounds onto)."""
        return {rel: self.config.scheme() for rel in selected}

    def starts(self, selected: dict[str, str], weights: dict, grids: dict, stats) -> dict[str, torch.Tensor] | None:
        """The weights the steps start rounding from (None: the layers' own)."""
        return self._gptq_starts(selected, weights, grids, stats) if self.config.init is Start.GPTQ else None

    def rounding(self, selected: dict[str, str], weights: dict, stats) -> tuple[dict, dict[str, torch.Tensor] | None]:
        """Each selected layer's grid (`grids`) and the weights the steps start rounding from (`starts`)."""
        grids = self.grids(selected, weights, stats)
        return grids, self.starts(selected, weights, grids, stats)

    def keep_layer(self, name: str, quant, info: dict) -> None:
        """Hand the layer ``name``'s result (its grid's ``finish``) on: for the engine to pack."""
        self.keep_outcome(name, LayerOutcome(quant.weight, info, quant=quant))

    def transform_block(self, block, layers, stats, replay=None) -> list[LayerReport]:
        if replay is None or replay.inputs is None or replay.reference is None:
            raise CompressError(f"autoround fits decoder blocks: exclude {next(iter(layers))}, outside them")
        start = time.perf_counter()
        relative = {module: name for name, module in block.named_modules()}
        selected = {relative[m]: full for full, m in layers.items()}  # relative name -> full name
        modules = {rel: block.get_submodule(rel) for rel in selected}
        weights = {rel: get_weight(m).detach().float() for rel, m in modules.items()}
        grids, starts = self.rounding(selected, weights, stats)
        stream = replay.inputs if self.config.enable_quanted_input else replay.reference.inputs
        inputs = _everyones(replay.ranks, _windows(stream))
        targets = _everyones(replay.ranks, [call[0] for call in _windows([(y, (), {}) for y in replay.reference.outputs()])])
        fixed = {name: _graph_ready(p.detach()) for name, p in block.named_parameters()}

        def forward(ws: dict[str, torch.Tensor], call) -> torch.Tensor:
            swapped = dict(fixed)
            for rel, w in ws.items():
                stored = modules[rel].weight
                swapped[f"{rel}.weight"] = (w.t() if is_conv1d(modules[rel]) else w).to(stored.dtype)
            hidden, args, kwargs = _graph_ready(call)
            return block_output(functional_call(block, swapped, (hidden, *args), kwargs))

        result = autoround(forward, weights, inputs, targets, self.config.core(), grids, starts, _summing(replay.ranks))
        reports = []
        with torch.no_grad():
            for rel, full in selected.items():
                quant = result.layers[rel]
                set_weight(modules[rel], quant.weight)
                info = {**quant.stats, **result.stats}
                self.keep_layer(full, quant, info)
                reports.append(LayerReport(full, tuple(weights[rel].shape), 0.0, info))
        for report in reports:  # one fit serves the whole block: share its time evenly
            report.seconds = (time.perf_counter() - start) / len(reports)
        return reports
