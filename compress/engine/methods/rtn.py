"""Round-to-nearest as an engine method (needs no calibration data), and the weight-grid settings the weight
quantizers share: the integer grid (`WeightQuantConfig`) and, for RTN and GPTQ, the float grids and the
activation quantization recorded beside the weights (`GridQuantConfig`, `InputQuantization`)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

from pydantic import Field, model_validator

from compress.errors import CompressError
from compress.engine.methods.base import LayerOutcome, Method, MethodConfig
from compress.engine.statistics import Stat
from compress.quantizers.activations import ActivationPreset, ActivationScheme, static_scale
from compress.quantizers.float_grid import FloatGrid, FloatScheme, require_float8
from compress.quantizers.grid import MAX_BITS, MIN_BITS, QuantScheme
from compress.quantizers.rtn import rtn
from compress.engine.registry import register_method


# "auto": the largest of 128, 64, 32 dividing every selected layer's in_features, chosen by the runner
GroupSize = int | Literal["auto"]


class WeightQuantConfig(MethodConfig):
    """The weight grid shared by weight quantizers: bits, group size, symmetry."""

    bits: int = Field(4, ge=MIN_BITS, le=MAX_BITS, description="bit width of the weight codes")
    group_size: GroupSize = Field(
        "auto", description="columns per scale/zero group; -1 for one group per output channel; auto: the largest of 128, 64, 32 "
        "dividing every selected layer")
    symmetric: bool = Field(True, description="symmetric grid (zero point at the middle code)")
    full_range: bool = Field(False, description="symmetric grid whose step is max|w| / 2**(bits-1): each group's extreme on "
                                                "the lowest code, the scale signed (auto-round's int_sym; finer at 2-3 bits)")

    @model_validator(mode="after")
    def _full_range_symmetric(self):
        if self.full_range and not self.symmetric:
            raise ValueError("full_range is a symmetric grid: drop full_range, or drop symmetric=false")
        return self

    def scheme(self) -> QuantScheme:
        return QuantScheme(self.bits, self.symmetric, self.group_size, self.full_range)


def check_group_size(name: str, in_features: int, group_size: GroupSize) -> None:
    if group_size == "auto":
        raise CompressError(f"group size auto reached {name} unresolved: run the stage through a recipe, or give a number")
    if group_size != -1 and (group_size < 1 or in_features % group_size):
        raise CompressError(
            f"group size {group_size} does not divide in_features {in_features} of {name}: "
            "use a divisor of it or -1 (per channel), or exclude the layer"
        )


class WeightGrid(str, enum.Enum):
    INT = "int"  # bits, group_size, symmetric
    FP8 = "fp8"  # E4M3 elements, float32 scale per channel (group -1), group, block (block_rows) or tensor
    NVFP4 = "nvfp4"  # E2M1 elements, E4M3 scale per 16 + float32 global scale
    MXFP4 = "mxfp4"  # E2M1 elements, power-of-two scale per 32


# which weight grid each activation quantization is stored beside (compressed-tensors' layouts)
_ACTIVATION_GRID = {
    ActivationPreset.INT8_TOKEN: WeightGrid.INT, ActivationPreset.INT8_TENSOR: WeightGrid.INT, ActivationPreset.INT4_TOKEN: WeightGrid.INT,
    ActivationPreset.FP8_TOKEN: WeightGrid.FP8, ActivationPreset.FP8_TENSOR: WeightGrid.FP8, ActivationPreset.FP8_GROUP: WeightGrid.FP8,
    ActivationPreset.NVFP4: WeightGrid.NVFP4, ActivationPreset.MXFP4: WeightGrid.MXFP4,
}
_FLOAT_DEFAULTS = {WeightGrid.FP8: (8, -1), WeightGrid.NVFP4: (4, 16), WeightGrid.MXFP4: (4, 32)}  # bits, group_size


class GridQuantConfig(WeightQuantConfig):
    """`WeightQuantConfig` plus float grids and the quantization of the layers' inputs (W8A8, FP8, W4A4)."""

    grid: WeightGrid = Field(WeightGrid.INT, description="int (bits/group_size/symmetric) or float elements: fp8, nvfp4, mxfp4")
    block_rows: int = Field(1, description="fp8: rows sharing a scale: 1, N (N x group_size blocks, e.g. 128) or -1 (per tensor, group_size -1)")
    activations: ActivationPreset | None = Field(
        None, description="also quantize the layers' inputs: int8-token, int8-tensor, int4-token (simulated: --format fake), fp8-token, fp8-tensor, fp8-group, nvfp4, mxfp4"
    )

    @model_validator(mode="before")
    @classmethod
    def _float_defaults(cls, data: Any) -> Any:
        """A float grid fixes its element width and (FP4) its group size: fill them in unless given."""
        if isinstance(data, dict) and data.get("grid") in [g.value for g in _FLOAT_DEFAULTS] + list(_FLOAT_DEFAULTS):
            bits, group_size = _FLOAT_DEFAULTS[WeightGrid(data["grid"])]
            data = {"bits": bits, "group_size": group_size, **data}
        return data

    @model_validator(mode="after")
    def _consistent(self):
        if self.grid is WeightGrid.INT:
            if self.block_rows != 1:
                raise ValueError("block_rows is for fp8 block scales: set grid fp8 (or use scheme fp8-block)")
        else:
            bits = _FLOAT_DEFAULTS[self.grid][0]
            if self.bits != bits:
                raise ValueError(f"{self.grid.value} elements have {bits} bits: drop bits or set it to {bits}")
            if not self.symmetric:
                raise ValueError(f"{self.grid.value} is a symmetric float grid: drop symmetric=false")
            if self.full_range:
                raise ValueError(f"full_range is an integer grid's: drop it for {self.grid.value}")
            if self.group_size == "auto":
                raise ValueError(f"group size auto chooses among integer group sizes: give {self.grid.value} a group size")
            self.scheme()  # the float grid's own checks (NVFP4 group 16, MXFP4 group 32, block rows)
        if self.activations is not None:
            grid = _ACTIVATION_GRID[self.activations]
            if grid is not self.grid:
                raise ValueError(f"activations {self.activations.value} are stored beside {grid.value} weights: set grid {grid.value}")
            eight = self.activations.scheme().bits == 8
            if grid is WeightGrid.INT and eight and (self.bits != 8 or self.group_size != -1 or not self.symmetric):
                raise ValueError("int8 activations (W8A8) go with 8-bit symmetric per-channel weights: set bits 8, group_size -1")
        return self

    def scheme(self) -> QuantScheme | FloatScheme:
        if self.grid is WeightGrid.INT:
            return super().scheme()
        try:
            return FloatScheme(FloatGrid(self.grid.value), self.group_size, self.block_rows)
        except ValueError as exc:
            raise ValueError(str(exc).replace("group_size", "group size")) from None

    def activation_scheme(self) -> ActivationScheme | None:
        return None if self.activations is None else self.activations.scheme()


class InputQuantization:
    """For methods on a `GridQuantConfig`: calibrate static input scales, mark the layers whose inputs are
    quantized, and record the activation settings (``activations``, ``activation_layers``) as SmoothQuant does."""

    learned_state = ("input_scales",)  # kept over the blocks for the record; a resumed run restores it (engine/journal.py)

    def input_stats(self) -> frozenset[Stat]:
        scheme = self.config.activation_scheme()
        return frozenset({Stat.INPUT_ABSMAX}) if scheme is not None and not scheme.dynamic else frozenset()

    def check_grid(self, name: str, in_features: int) -> None:
        check_group_size(name, in_features, self.config.group_size)
        scheme = self.config.activation_scheme()
        if scheme is not None and scheme.group_size and in_features % scheme.group_size:
            raise CompressError(
                f"activations {self.config.activations.value} quantize groups of {scheme.group_size} inputs, which do not divide "
                f"in_features {in_features} of {name}: exclude the layer or choose other activations"
            )

    def prepare_grid(self) -> None:
        acts = self.config.activations
        if self.config.grid is not WeightGrid.INT or (acts is not None and _ACTIVATION_GRID[acts] is not WeightGrid.INT):
            require_float8()

    def with_inputs(self, name: str, outcome: LayerOutcome, stats: dict) -> LayerOutcome:
        scheme = self.config.activation_scheme()
        if scheme is None:
            return outcome
        scale = None if scheme.dynamic else static_scale(stats[Stat.INPUT_ABSMAX], scheme)
        self.__dict__.setdefault("input_scales", {})[name] = None if scale is None else scale.item()
        return dataclasses.replace(outcome, input_scale=scale, quantizes_input=True)

    def record(self) -> dict[str, Any]:
        record = super().record()
        defaults = {"grid": WeightGrid.INT.value, "block_rows": 1, "activations": None, "full_range": False}  # records of integer runs stay as they were
        record = {k: v for k, v in record.items() if k not in defaults or v != defaults[k]}
        scheme = self.config.activation_scheme()
        if scheme is not None:
            record["activations"] = scheme.to_record()
            record["activation_layers"] = dict(self.__dict__.get("input_scales", {}))
        return record


@register_method("rtn")
class RTN(InputQuantization, Method):
    """Round each weight to the nearest point of its group's grid (integer min-max, or a float grid)."""

    Config = GridQuantConfig
    takes_stored_dtype = True  # `rtn` widens a bfloat16 weight in its compiled loop, or copies it to float32 itself

    @property
    def needs(self) -> frozenset[Stat]:
        return self.input_stats()

    def prepare(self, model) -> None:
        self.prepare_grid()

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        self.check_grid(name, in_features)

    def transform_layer(self, name, weight, stats) -> LayerOutcome:
        # the layer's own weight (`takes_stored_dtype`), which the engine sets to the values: written over at once
        result = rtn(weight, self.config.scheme(), overwrite=True)
        return self.with_inputs(name, LayerOutcome(result.weight, dict(result.stats), quant=result), stats)
