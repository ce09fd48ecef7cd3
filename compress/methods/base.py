"""The contract between the layer-by-layer engine and a compression method.

A method says which calibration statistics it needs (`needs`) and transforms one decoder block at a
time. Most methods work layer by layer and only implement `transform_layer`, a thin adapter around a
pure algorithm in ``quantizers/`` or ``pruners/``; methods that couple layers (scaling folded between
them) override `transform_block`. The engine never asks a method's name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from compress.model_io import get_weight, set_weight
from compress.statistics import Stat


class MethodConfig(BaseModel):
    """Base for every method's typed configuration: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


@dataclass
class LayerOutcome:
    weight: torch.Tensor  # new weight [out, in], float32
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]  # (out_features, in_features)
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


class Method:
    name: ClassVar[str] = ""
    Config: ClassVar[type[MethodConfig]] = MethodConfig

    def __init__(self, config: MethodConfig):
        self.config = config

    @property
    def needs(self) -> frozenset[Stat]:
        """Statistics of each layer's input this method needs (empty: no calibration data)."""
        return frozenset()

    @property
    def sequential(self) -> bool:
        """True: transform a block's layers group by group in forward order, each group's statistics
        collected after the groups before it were transformed (GPTQ's "true sequential")."""
        return False

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        """Raise `CompressError` before any work starts if this layer cannot take the method."""

    def transform_layer(self, name: str, weight: torch.Tensor, stats: dict[Stat, torch.Tensor]) -> LayerOutcome:
        raise NotImplementedError

    def transform_block(
        self, block: nn.Module, layers: dict[str, nn.Module], stats: dict[str, dict[Stat, torch.Tensor]]
    ) -> list[LayerReport]:
        """Transform the selected layers of one block in place; the default goes layer by layer."""
        reports = []
        for name, module in layers.items():
            start = time.perf_counter()
            weight = get_weight(module).detach().float()
            outcome = self.transform_layer(name, weight, stats.get(name, {}))
            set_weight(module, outcome.weight)
            reports.append(LayerReport(name, tuple(weight.shape), time.perf_counter() - start, outcome.info))
        return reports

    def record(self) -> dict[str, Any]:
        """What is written to the output's config.json about this method."""
        return {"method": self.name, **self.config.model_dump(mode="json")}


class HessianMethod(Method):
    """Base for second-order solvers (GPTQ, SparseGPT): Hessian statistics, optional true-sequential,
    and solver failures reported as user errors naming the layer."""

    label: ClassVar[str] = ""

    @property
    def needs(self) -> frozenset[Stat]:
        return frozenset({Stat.HESSIAN})

    @property
    def sequential(self) -> bool:
        return self.config.true_sequential

    def solve(self, name: str, solver, weight: torch.Tensor, stats: dict[Stat, torch.Tensor], config, keys: tuple[str, ...]):
        """Run ``solver(weight, H, config)``; returns the layer outcome with the ``keys`` of its stats."""
        from compress.errors import CompressError

        try:
            result = solver(weight, stats[Stat.HESSIAN], config)
        except ValueError as exc:
            raise CompressError(f"{self.label} failed on {name}: {exc}") from None
        return LayerOutcome(result.weight, {k: result.stats[k] for k in keys if k in result.stats})
