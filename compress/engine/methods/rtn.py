"""Round-to-nearest as an engine method: needs no calibration data."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from compress.errors import CompressError
from compress.engine.methods.base import LayerOutcome, Method, MethodConfig
from compress.quantizers.grid import MAX_BITS, MIN_BITS, QuantScheme
from compress.quantizers.rtn import rtn
from compress.engine.registry import register_method


# "auto": the largest of 128, 64, 32 dividing every selected layer's in_features, chosen by the runner
GroupSize = int | Literal["auto"]


class WeightQuantConfig(MethodConfig):
    """The weight grid shared by weight quantizers: bits, group size, symmetry."""

    bits: int = Field(4, ge=MIN_BITS, le=MAX_BITS, description="bit width of the weight codes")
    group_size: GroupSize = Field(128, description="columns per scale/zero group; -1 for one group per output channel; auto")
    symmetric: bool = Field(True, description="symmetric grid (zero point at the middle code)")

    def scheme(self) -> QuantScheme:
        return QuantScheme(self.bits, self.symmetric, self.group_size)


def check_group_size(name: str, in_features: int, group_size: GroupSize) -> None:
    if group_size == "auto":
        raise CompressError(f"group size auto reached {name} unresolved: run the stage through a recipe, or give a number")
    if group_size != -1 and (group_size < 1 or in_features % group_size):
        raise CompressError(
            f"group size {group_size} does not divide in_features {in_features} of {name}: "
            "use a divisor of it or -1 (per channel), or exclude the layer"
        )


@register_method("rtn")
class RTN(Method):
    """Round each weight to the nearest point of its group's min-max grid."""

    Config = WeightQuantConfig

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        check_group_size(name, in_features, self.config.group_size)

    def transform_layer(self, name, weight, stats) -> LayerOutcome:
        result = rtn(weight, self.config.scheme())
        return LayerOutcome(result.weight, dict(result.stats), quant=result)
