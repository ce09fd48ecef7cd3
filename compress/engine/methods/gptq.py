"""GPTQ as an engine method: Hessian statistics, true-sequential by default."""

from __future__ import annotations

from pydantic import Field, model_validator

from compress.engine.methods.base import HessianMethod, LayerOutcome, SolverConfig
from compress.engine.methods.rtn import GridQuantConfig, InputQuantization, WeightGrid
from compress.engine.statistics import Stat
from compress.quantizers.gptq import GPTQConfig, gptq
from compress.engine.registry import register_method


class GPTQMethodConfig(GridQuantConfig, SolverConfig):
    # on by default, as llm-compressor's static act-order: lower KLD on every setting measured (README, GPTQ defaults)
    act_order: bool = Field(True, description="process columns by decreasing Hessian diagonal (static groups)")
    # None: on for integer grids (lower KLD on every seed of the reference model and SmolLM2, README), off for float grids
    mse: bool | None = Field(None, description="search each group's clipping range for the lowest weight error (default: on for int grids)")
    refit_scales: bool = Field(True, description="after the column loop, solve each group's scale on the whole Hessian with the "
                                                "codes kept (integer grids)")

    @model_validator(mode="after")
    def _mse_per_row(self):
        if self.mse and self.block_rows != 1:
            raise ValueError("mse chooses each row's clipping, which a scale shared by a block of rows cannot keep: drop mse")
        return self

    def clipping_search(self) -> bool:
        return self.grid is WeightGrid.INT if self.mse is None else self.mse


@register_method("gptq")
class GPTQ(InputQuantization, HessianMethod):
    """Quantize column by column, feeding each rounding error back into the columns not yet quantized
    (integer or float grids: the error fed back is that of the grid's own rounding)."""

    Config = GPTQMethodConfig
    label = "GPTQ"

    @property
    def needs(self) -> frozenset[Stat]:
        return super().needs | self.input_stats()

    def prepare(self, model) -> None:
        self.prepare_grid()

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        self.check_grid(name, in_features)

    def solved(self, name, weight, stats) -> LayerOutcome:
        cfg = self.config
        config = GPTQConfig(cfg.scheme(), block_size=cfg.block_size, damp=cfg.damp, act_order=cfg.act_order, mse=cfg.clipping_search(),
                            refit_scales=cfg.refit_scales)
        return self.solve(name, gptq, weight, stats, config, ("error", "rel_error", "damp", "damp_retries", "dead_columns"))

    def finish(self, name, outcome, stats) -> LayerOutcome:
        return self.with_inputs(name, outcome, stats)
