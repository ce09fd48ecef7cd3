"""A recipe's ``export:`` section and its dispatch: plain rounding (`gguf.export_gguf`) or the calibrated
methods (`calibrated.export_calibrated`). It lives with the recipes, not in `compress.export`, because it
may carry a per-tensor plan (`compress.run.plan`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from compress.errors import CompressError
from compress.export.calibrated import export_calibrated, method_configs
from compress.export.gguf import ExportConfig, ExportResult, GGUFMethod, export_gguf
from compress.formats.candidates import parse_candidate
from compress.formats.gguf.plan import Target
from compress.run.plan import PlanSpec, gguf_plan


class ExportSpec(BaseModel):
    """A recipe's ``export:`` section: after the run, also write the output checkpoint as one GGUF file.

    ```yaml
    export: {path: out/model-q4_k_m.gguf, type: q4_k_m, method: imatrix, imatrix: imatrix.gguf, overwrite: true}
    ```
    The stages must leave a dense checkpoint (``output.format: fake``) for the GGUF encoders to round.
    ``method: gptq`` or ``awq`` calibrate on the recipe's ``calibration`` section. ``plan:`` gives tensors
    their own GGML types as ``compress export --plan`` does: a plan file, an inline ``layers:`` mapping
    (layer or ``re:`` pattern -> type), or a sensitivity file with a target (``target_size: 2.1GB``);
    ``type`` then covers the tensors the plan does not list. ``options``: GPTQ/AWQ settings, e.g.
    ``{asymmetric: true}`` (as ``compress export -O``).
    """

    model_config = ConfigDict(extra="forbid")
    path: Path
    format: Literal["gguf"] = "gguf"
    type: Target = Target.q8_0
    method: GGUFMethod = GGUFMethod.rtn
    imatrix: Path | None = None
    plan: PlanSpec | None = None
    options: dict[str, Any] = {}  # GPTQ/AWQ settings of the calibrated methods (``compress export -O``)
    overwrite: bool = False

    @model_validator(mode="after")
    def _imatrix_matches_method(self):
        if (self.method == GGUFMethod.imatrix) != (self.imatrix is not None):
            raise ValueError("method imatrix needs an imatrix file (and only it takes one)")
        return self

    @model_validator(mode="after")
    def _options_of_the_method(self):
        if self.options and not self.method.calibrated:
            raise ValueError(f"options are GPTQ/AWQ settings; method {self.method.value} has none")
        if self.options:
            try:
                method_configs(self.method, self.options)
            except CompressError as exc:
                raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _inline_plan_names_ggml_types(self):
        for layer, name in (self.plan.layers or {}).items() if self.plan is not None else ():
            try:
                gguf = parse_candidate(name).is_gguf
            except CompressError as exc:
                raise ValueError(str(exc)) from None
            if not gguf:
                raise ValueError(f"the plan gives {layer} the integer grid {name}: an export plan names GGML types (q4_k, q6_k, ...)")
        return self


def export_from_spec(
    model: Path, spec: ExportSpec, progress: Callable[[str, int, int], None] | None = None, calibration=None, device: str = "cpu"
) -> ExportResult:
    """``calibration``: the recipe's `CalibrationSpec`, for the calibrated methods."""
    config = ExportConfig(model, spec.path, spec.type, spec.overwrite, spec.imatrix, method=spec.method.value)
    if spec.plan is not None:
        config = replace(config, types=gguf_plan(model, spec.plan, config)[1])
    if not spec.method.calibrated:
        return export_gguf(config, progress)
    if calibration is None:
        raise CompressError(f"export method {spec.method.value} needs calibration data: add a calibration section")
    gptq, awq, autoround = method_configs(spec.method, spec.options)
    return export_calibrated(config, spec.method, calibration, progress, gptq=gptq, awq=awq, device=device, autoround=autoround)
