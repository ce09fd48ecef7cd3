"""What the engine runs and returns: stages (a method on a selection of layers), observers of each block's
run, the run's result."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from compress.engine.methods.base import LayerReport, Method
from compress.engine.ranks import Ranks


class BlockObserver(Protocol):
    """Watches each compressed block compute its outputs on the calibration inputs (`Engine` ``observer``)."""

    name: str  # for messages

    def watch(self, block_name: str, block: nn.Module) -> AbstractContextManager: ...

    def combine(self, ranks: Ranks) -> None:
        """Merge what every rank watched (after each block's run)."""


@dataclass
class Stage:
    """One method applied to a selection of layers (full names).

    ``overrides`` (a per-layer plan): layers that run another instance of the stage's method, with their
    own settings; they are grouped and calibrated with the rest, each instance transforming its layers."""

    method: Method
    layers: dict[str, nn.Module]
    overrides: dict[str, Method] = field(default_factory=dict)

    def method_for(self, name: str) -> Method:
        return self.overrides.get(name, self.method)

    def methods(self) -> list[Method]:
        """Every instance that runs: the stage's method, then each distinct override."""
        return list({id(m): m for m in [self.method, *self.overrides.values()]}.values())

    def split(self, layers: dict[str, nn.Module]) -> list[tuple[Method, dict[str, nn.Module]]]:
        """``layers`` grouped by the instance that transforms them, in their order."""
        parts: dict[int, tuple[Method, dict[str, nn.Module]]] = {}
        for name, module in layers.items():
            method = self.method_for(name)
            parts.setdefault(id(method), (method, {}))[1][name] = module
        return list(parts.values())

    def needs_of(self, group: dict[str, nn.Module]) -> frozenset:
        """The statistics (`Stat`) ``group``'s layers need, each layer by the instance that transforms it."""
        return frozenset().union(*(self.method_for(name).needs for name in group))

    def layers_read(self, block: nn.Module, block_name: str, group: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """The layers of ``group`` whose inputs a statistics pass reads (`Method.layer_needs`)."""
        return {name: module for name, module in group.items()
                if self.method_for(name).layer_needs(block, name[len(block_name) + 1 :])}

    def readers_needs(self, block: nn.Module, block_name: str, readers: dict[str, nn.Module]) -> frozenset:
        """What the stage's method reads of ``readers``' inputs (`Method.layer_needs`), where it runs inside a
        later stage's pass (`compress.engine.one_pass.fused_stages`)."""
        return frozenset().union(*(self.method.layer_needs(block, n[len(block_name) + 1 :]) for n in readers))


@dataclass
class EngineResult:
    layers: list[LayerReport] = field(default_factory=list)
    blocks: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    peak_device_bytes: int | None = None
    final_hidden: list[torch.Tensor] | None = None  # the last block's outputs, when asked for
    final_reference: list[torch.Tensor] | None = None  # ... and the uncompressed model's (asymmetric calibration)
