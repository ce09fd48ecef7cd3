"""Pruning as engine methods: SparseGPT (Hessian), Wanda (input norms) and magnitude (no data).

Each takes exactly one target: ``sparsity`` (unstructured fraction) or ``pattern`` (N:M, e.g. "2:4").
SparseGPT optionally quantizes the kept weights in the same pass (``bits`` set: joint mode).
Each layer's info reports the ``sparsity`` actually reached (fraction of exact zeros).
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator, model_validator

from compress.errors import CompressError
from compress.engine.methods.base import HessianMethod, LayerOutcome, Method, MethodConfig, SolverConfig
from compress.engine.methods.rtn import GroupSize, check_group_size
from compress.pruners.magnitude import MagnitudeConfig, magnitude
from compress.pruners.masks import NM, Pattern, Unstructured
from compress.pruners.sparsegpt import SparseGPTConfig, rows_independent, sparsegpt
from compress.pruners.wanda import WandaConfig, wanda
from compress.quantizers.grid import MAX_BITS, MIN_BITS, QuantScheme
from compress.engine.registry import register_method
from compress.engine.statistics import Stat


class PruneConfig(MethodConfig):
    sparsity: Optional[float] = Field(None, gt=0, lt=1, description="unstructured: fraction of weights pruned per row")
    pattern: Optional[str] = Field(None, description='N:M semi-structured: keep N of every M input columns, e.g. "2:4"')

    @field_validator("pattern")
    @classmethod
    def _valid_pattern(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return value
        try:
            return str(NM.parse(value))
        except ValueError:
            raise ValueError(f'pattern {value!r} is not N:M with 0 < N < M: write e.g. "2:4" or "4:8"') from None

    @model_validator(mode="after")
    def _one_target(self):
        if (self.sparsity is None) == (self.pattern is None):
            raise ValueError('give exactly one of sparsity (e.g. 0.5) or pattern (e.g. "2:4")')
        return self

    def target(self) -> Pattern:
        return NM.parse(self.pattern) if self.pattern is not None else Unstructured(self.sparsity)


def check_pattern(name: str, in_features: int, pattern: Pattern) -> None:
    if isinstance(pattern, NM) and in_features % pattern.m:
        raise CompressError(
            f"N:M group size {pattern.m} does not divide in_features {in_features} of {name}: "
            "use another pattern, or exclude the layer"
        )


class _Pruner(Method):
    Config = PruneConfig

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        check_pattern(name, in_features, self.config.target())


@register_method("magnitude")
class Magnitude(_Pruner):
    """Zero the smallest-magnitude weights per row (or per N:M group); needs no calibration data."""

    def transform_layer(self, name, weight, stats) -> LayerOutcome:
        result = magnitude(weight, MagnitudeConfig(self.config.target()))
        return LayerOutcome(result.weight, dict(result.stats))


@register_method("wanda")
class Wanda(_Pruner):
    """Zero the lowest |W_ij|·‖X_j‖₂ per row (or per N:M group); no weight update."""

    @property
    def needs(self) -> frozenset[Stat]:
        return frozenset({Stat.INPUT_L2})

    def transform_layer(self, name, weight, stats) -> LayerOutcome:
        try:
            result = wanda(weight, stats[Stat.INPUT_L2], WandaConfig(self.config.target()))
        except ValueError as exc:
            raise CompressError(f"Wanda failed on {name}: {exc}") from None
        return LayerOutcome(result.weight, dict(result.stats))


class SparseGPTMethodConfig(PruneConfig, SolverConfig):  # block_size is also the unstructured mask's column block
    bits: Optional[int] = Field(None, ge=MIN_BITS, le=MAX_BITS, description="joint mode: also quantize kept weights (None: no)")
    group_size: GroupSize = Field(
        "auto", description="joint mode: columns per scale/zero group; -1 per output channel; auto: the largest of 128, 64, 32 "
        "dividing every selected layer")
    symmetric: bool = Field(True, description="joint mode: symmetric grid")

    @model_validator(mode="after")
    def _block_fits_pattern(self):
        if self.pattern is not None and self.block_size % NM.parse(self.pattern).m:
            raise ValueError(f"block_size {self.block_size} must be a multiple of M in pattern {self.pattern}")
        return self

    def scheme(self) -> QuantScheme | None:
        return None if self.bits is None else QuantScheme(self.bits, self.symmetric, self.group_size)

    def wants_auto_group_size(self) -> bool:
        return self.bits is not None and super().wants_auto_group_size()  # pruning alone has no groups


@register_method("sparsegpt")
class SparseGPT(HessianMethod, _Pruner):
    """Prune column by column with OBS reconstruction of the kept weights (optionally quantizing them)."""

    Config = SparseGPTMethodConfig
    label = "SparseGPT"

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        super().check_layer(name, out_features, in_features)
        if self.config.bits is not None:
            check_group_size(name, in_features, self.config.group_size)

    @property
    def row_parallel(self) -> bool:
        return super().row_parallel and rows_independent(self._solver_config())

    def _solver_config(self) -> SparseGPTConfig:
        cfg = self.config
        return SparseGPTConfig(cfg.target(), block_size=cfg.block_size, damp=cfg.damp, scheme=cfg.scheme())

    def solved(self, name, weight, stats) -> LayerOutcome:
        config = self._solver_config()
        keys = ("sparsity", "error", "rel_error", "damp", "damp_retries", "dead_columns")
        return self.solve(name, sparsegpt, weight, stats, config, keys)
