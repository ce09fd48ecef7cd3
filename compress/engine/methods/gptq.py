"""GPTQ as an engine method: Hessian statistics, true-sequential by default."""

from __future__ import annotations

from pydantic import Field

from compress.engine.methods.base import HessianMethod, LayerOutcome, SolverConfig
from compress.engine.methods.rtn import WeightQuantConfig, check_group_size
from compress.quantizers.gptq import GPTQConfig, gptq
from compress.engine.registry import register_method


class GPTQMethodConfig(WeightQuantConfig, SolverConfig):
    # on by default, as llm-compressor's static act-order: lower KLD on every setting measured (README, GPTQ defaults)
    act_order: bool = Field(True, description="process columns by decreasing Hessian diagonal (static groups)")
    mse: bool = Field(False, description="search each group's clipping range for the lowest weight error")


@register_method("gptq")
class GPTQ(HessianMethod):
    """Quantize column by column, feeding each rounding error back into the columns not yet quantized."""

    Config = GPTQMethodConfig
    label = "GPTQ"

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        check_group_size(name, in_features, self.config.group_size)

    def transform_layer(self, name, weight, stats) -> LayerOutcome:
        cfg = self.config
        config = GPTQConfig(cfg.scheme(), block_size=cfg.block_size, damp=cfg.damp, act_order=cfg.act_order, mse=cfg.mse)
        return self.solve(name, gptq, weight, stats, config, ("error", "rel_error", "damp", "damp_retries", "dead_columns"))
