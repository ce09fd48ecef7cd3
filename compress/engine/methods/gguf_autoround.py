"""AutoRound behind the calibrated GGUF export (``compress export --method autoround``): each decoder block's layers
learn their rounding inside their GGML types' block grids, together, on the block's output
(`compress.engine.methods.autoround.AutoRound`'s fit, with `compress.quantizers.gguf_autoround.GGMLRounding` as each
layer's grid).

Each layer's grid is the type's own fit of its float weight, importance-weighted by its inputs' mean squares
(``weighted_fit``, what llama.cpp's imatrix holds) or plain; then only the rounding offsets are learned: ggml's
encoder sets the scales, so auto-round's min/max tuning does not apply. Every layer's bytes are kept in ``encoded``
for the GGUF writer, as `compress.engine.methods.gguf.GGUFGPTQ` keeps GPTQ's, and the layer is set to their decode,
so the next block fits on the quantized model's stream. ``init=gptq`` starts the steps from GPTQ in the GGML grids
(`compress.quantizers.gguf_autoround.gptq_start`) on each layer's Hessian of the block's inputs, which the method then
asks the engine for: GPTQ's grids and codes, so no steps write GPTQ's bytes. The output layer and the token
embeddings (tied or not) are not decoder-block layers: the writer rounds them with ggml's encoder.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from compress.engine.methods.autoround import AutoRound, Start
from compress.engine.methods.base import MethodConfig
from compress.engine.statistics import Stat
from compress.formats.gguf.sizes import GGMLType
from compress.errors import CompressError
from compress.quantizers.autoround import AutoRoundConfig
from compress.quantizers.gguf_autoround import GGMLRounding, check_affine, gptq_start
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, floored_importance


class GGUFAutoRoundMethodConfig(MethodConfig):
    """auto-round's names for the settings that apply in GGML's grids."""

    iters: int = Field(200, ge=0, description="signed-gradient steps per block (0: ggml's nearest rounding on the fitted grids)")
    lr: float | None = Field(None, gt=0, description="step size of the rounding offsets, decayed linearly to 0 (default 1/iters)")
    batch_size: int = Field(8, ge=1, description="calibration windows per step")
    enable_quanted_input: bool = Field(True, description="fit each block on the compressed model's inputs (else the uncompressed model's)")
    not_use_best_mse: bool = Field(False, description="keep the last step's rounding instead of the lowest-loss step's")
    seed: int = Field(0, description="order of the calibration windows over the steps")
    weighted_fit: bool = Field(True, description="fit each layer's GGML grid with its inputs' mean squares as importance "
                                                 "(the imatrix's values; init=gptq: diag(H), as GPTQ's); "
                                                 "false: ggml's plain fit")
    init: Start = Field(Start.RTN, description="rounding the steps start from: rtn (ggml's nearest on the fitted grids) "
                                               "or gptq (GPTQ in the GGML grids, from each layer's Hessian: its grids "
                                               "and codes)")
    damp: float = Field(0.01, gt=0, description="with init=gptq: GPTQ's damping, λ = damp · mean(diag H)")

    def core(self) -> AutoRoundConfig:
        return AutoRoundConfig(self.iters, self.lr, None, self.batch_size, minmax_tuning=False,
                               best=not self.not_use_best_mse, seed=self.seed)


class GGUFAutoRound(AutoRound):
    """AutoRound's rounding learned in each layer's GGML type; ``types``: layer name -> type."""

    name = "autoround"
    Config = GGUFAutoRoundMethodConfig
    learned_state = ("encoded",)  # each layer's bytes

    def __init__(self, config: GGUFAutoRoundMethodConfig, types: dict[str, GGMLType]):
        super().__init__(config)
        self.types = types
        self.encoded: dict[str, tuple[GGMLType, np.ndarray]] = {}  # layer name -> (type, [out, row_bytes])

    @property
    def needs(self) -> frozenset[Stat]:
        if self.config.init is Start.GPTQ:
            return frozenset({Stat.HESSIAN})  # GPTQ's weighted fits take diag(H) as the importance
        return frozenset({Stat.INPUT_L2}) if self.config.weighted_fit else frozenset()

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        """The type plan has chosen each layer a type whose blocks fit; it must be an affine one."""
        check_affine(self.types[name], name)

    def grids(self, selected: dict[str, str], weights: dict, stats) -> dict[str, GGMLRounding]:
        fitted = {}
        for rel, full in selected.items():
            importance = None
            if self.config.weighted_fit:
                squares = stats[full][Stat.INPUT_L2].double().square()  # Σx², the imatrix's values up to 1/n
                importance = floored_importance(squares).float()
            fitted[rel] = GGMLRounding.fit(self.types[full], weights[rel], importance)
        return fitted

    def starts(self, selected, weights, grids, stats) -> None:
        return None  # the steps start at ggml's nearest rounding on the fitted grids

    def rounding(self, selected: dict[str, str], weights: dict, stats) -> tuple[dict, dict[str, torch.Tensor] | None]:
        """init=gptq: each layer's GPTQ in its type's grids (`gptq_start`): GPTQ's grids, and its columns as it rounded
        them as the start. The Hessians are those of the block's inputs, one pass per block (GPTQ's
        ``true_sequential=false``)."""
        if self.config.init is not Start.GPTQ:
            return super().rounding(selected, weights, stats)
        grids, starts = {}, {}
        for rel, full in selected.items():
            config = GGUFGPTQConfig(self.types[full], damp=self.config.damp, weighted_fit=self.config.weighted_fit,
                                    compare_rtn=False)
            try:
                grids[rel], starts[rel] = gptq_start(weights[rel], stats[full][Stat.HESSIAN], config)
            except ValueError as exc:
                raise CompressError(f"autoround's GPTQ start failed on {full}: {exc}") from None
        return grids, starts

    def keep_layer(self, name: str, quant, info: dict) -> None:
        self.encoded[name] = (quant.kind, quant.data)
        info["type"] = quant.kind.name
