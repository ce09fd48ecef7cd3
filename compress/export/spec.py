"""A recipe's ``export:`` section and its dispatch: plain rounding (`gguf.export_gguf`) or the calibrated
methods (`calibrated.export_calibrated`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from compress.errors import CompressError
from compress.export.calibrated import export_calibrated
from compress.export.gguf import ExportConfig, ExportResult, GGUFMethod, export_gguf
from compress.formats.gguf.plan import Target


class ExportSpec(BaseModel):
    """A recipe's ``export:`` section: after the run, also write the output checkpoint as one GGUF file.

    ```yaml
    export: {path: out/model-q4_k_m.gguf, type: q4_k_m, method: imatrix, imatrix: imatrix.gguf, overwrite: true}
    ```
    The stages must leave a dense checkpoint (``output.format: fake``) for the GGUF encoders to round.
    ``method: gptq`` or ``awq`` calibrate on the recipe's ``calibration`` section.
    """

    model_config = ConfigDict(extra="forbid")
    path: Path
    format: Literal["gguf"] = "gguf"
    type: Target = Target.q8_0
    method: GGUFMethod = GGUFMethod.rtn
    imatrix: Path | None = None
    overwrite: bool = False

    @model_validator(mode="after")
    def _imatrix_matches_method(self):
        if (self.method == GGUFMethod.imatrix) != (self.imatrix is not None):
            raise ValueError("method imatrix needs an imatrix file (and only it takes one)")
        return self


def export_from_spec(
    model: Path, spec: ExportSpec, progress: Callable[[str, int, int], None] | None = None, calibration=None, device: str = "cpu"
) -> ExportResult:
    """``calibration``: the recipe's `CalibrationSpec`, for the calibrated methods."""
    config = ExportConfig(model, spec.path, spec.type, spec.overwrite, spec.imatrix, method=spec.method.value)
    if not spec.method.calibrated:
        return export_gguf(config, progress)
    if calibration is None:
        raise CompressError(f"export method {spec.method.value} needs calibration data: add a calibration section")
    return export_calibrated(config, spec.method, calibration, progress, device=device)
