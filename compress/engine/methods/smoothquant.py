"""SmoothQuant W8A8 as an engine method: smoothing folded into the norms, int8 weights, int8 activations.

The weights are quantized here with round-to-nearest (int8, per output channel, symmetric) unless
``quantize_weights`` is false, in which case a later stage (GPTQ) quantizes the smoothed weights. The
activation settings and each layer's static scale (per-tensor mode) go into the output's
``compression`` record, and the evaluator quantizes those layers' inputs in the forward pass.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from pydantic import Field

from compress.checkpoints.architecture import resolve_groups
from compress.engine.methods.base import LayerOutcome, LayerReport, Method, MethodConfig
from compress.checkpoints.model_io import get_weight, set_weight
from compress.quantizers.activations import ActGranularity, ActivationScheme, static_scale
from compress.quantizers.grid import QuantScheme
from compress.quantizers.rtn import rtn
from compress.quantizers.smoothquant import smoothing_scales
from compress.engine.registry import register_method
from compress.engine.statistics import Stat


class ActivationMode(str, enum.Enum):
    TOKEN = "token"  # per-token scales computed at run time
    TENSOR = "tensor"  # one static scale per layer, calibrated here


class SmoothQuantConfig(MethodConfig):
    # 0.8: lowest KLD on SmolLM2 and the reference model over 3 seeds (README, SmoothQuant and AWQ defaults)
    alpha: float = Field(0.8, ge=0, le=1, description="migration strength: s = max|X|^α / max|W|^(1-α)")
    smooth: bool = Field(True, description="fold smoothing scales into the norms (false: plain W8A8)")
    activations: ActivationMode = Field(ActivationMode.TOKEN, description="int8 activation scales: token (dynamic) or tensor (static)")
    quantize_weights: bool = Field(True, description="round weights to int8 per channel here (false: leave to a later GPTQ stage)")

    def activation_scheme(self) -> ActivationScheme:
        token = self.activations == ActivationMode.TOKEN
        return ActivationScheme(8, ActGranularity.TOKEN if token else ActGranularity.TENSOR, dynamic=token)


@register_method("smoothquant")
class SmoothQuant(Method):
    """Migrate activation outliers into the weights, then quantize weights and activations to int8."""

    learned_state = ("input_scales",)  # kept over the blocks for the record; a resumed run restores it (engine/journal.py)

    Config = SmoothQuantConfig

    def __init__(self, config: SmoothQuantConfig):
        super().__init__(config)
        self.input_scales: dict[str, float | None] = {}
        self._norm_groups_of: tuple = (None, [])  # (block, groups): `_norm_groups`' last answer

    @property
    def needs(self) -> frozenset[Stat]:
        return frozenset({Stat.INPUT_ABSMAX})

    def layer_needs(self, block, relative: str) -> frozenset[Stat]:
        """Static activation scales read every layer's input range; dynamic ones only the smoothed layers' (those fed
        by a norm), and without smoothing none: the statistics pass then stops at the last norm-fed layer's call."""
        if self.config.activations == ActivationMode.TENSOR:
            return self.needs
        smoothed = self.config.smooth and any(relative in layers for _, layers in self._norm_groups(block))
        return self.needs if smoothed else frozenset()

    def producers(self, block) -> list[tuple[str, tuple[str, ...]]] | None:
        """With dynamic activation scales, the norms it smooths and the layers each feeds: its statistics and folds
        then ride the next stage's one pass (static scales read the other layers' inputs too: pass by pass)."""
        if self.config.activations == ActivationMode.TENSOR:
            return None
        return self._norm_groups(block) if self.config.smooth else []

    def _norm_groups(self, block) -> list[tuple[str, tuple[str, ...]]]:
        """Each norm of ``block`` that `transform_block` smooths and the layers it feeds (names in the block); kept for
        the block, which `layer_needs` asks about layer by layer."""
        if self._norm_groups_of[0] is not block:
            groups = [(r.group.prev, tuple(r.group.layers)) for r in resolve_groups(block, self.model_type) if r.from_norm]
            self._norm_groups_of = (block, groups)
        return self._norm_groups_of[1]

    def prepare(self, model) -> None:
        self.model_type = model.config.model_type
        if self.config.smooth:
            from compress.checkpoints.architecture import block_map

            block_map(self.model_type)  # an architecture without a mapping fails here, before any work

    def transform_block(self, block, layers, stats, replay=None) -> list[LayerReport]:
        start = time.perf_counter()
        relative = {module: name for name, module in block.named_modules()}
        selected = {relative[m]: full for full, m in layers.items()}
        absmax = {rel: stats[full][Stat.INPUT_ABSMAX].clone() for rel, full in selected.items() if stats[full]}
        info: dict[str, dict[str, Any]] = {rel: {} for rel in selected}
        if self.config.smooth:
            for resolved in resolve_groups(block, self.model_type):
                present = [n for n in resolved.group.layers if n in selected]
                if not resolved.from_norm or not present:
                    continue  # the paper smooths the inputs of the norm-fed layers (QKV, FC1)
                modules = resolved.layers
                scales = smoothing_scales(absmax[present[0]], [get_weight(m) for m in modules], self.config.alpha)
                resolved.fold(scales.to(get_weight(modules[0]).device))
                for name in present:
                    before = absmax[name].max().item()
                    absmax[name] = absmax[name] / scales.to(absmax[name].device)
                    info[name]["act_range_ratio"] = round(before / max(absmax[name].max().item(), 1e-12), 3)
        scheme = self.config.activation_scheme()
        reports = []
        for rel, full in selected.items():
            module = block.get_submodule(rel)
            weight = get_weight(module).detach().float()
            scale = None if scheme.dynamic else static_scale(absmax[rel], scheme)
            self.input_scales[full] = None if scale is None else scale.item()
            quant = None
            if self.config.quantize_weights:
                quant = rtn(weight, QuantScheme(8, True, -1))
                set_weight(module, quant.weight)
                info[rel].update(quant.stats)
            self.keep_outcome(full, LayerOutcome(get_weight(module).detach().float(), info[rel], quant, scale, quantizes_input=True))
            reports.append(LayerReport(full, tuple(weight.shape), 0.0, info[rel]))
        for report in reports:
            report.seconds = (time.perf_counter() - start) / len(reports)
        return reports

    def record(self) -> dict[str, Any]:
        return {
            **super().record(),
            "activations": self.config.activation_scheme().to_record(),
            "activation_layers": dict(self.input_scales),
        }
