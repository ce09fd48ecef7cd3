"""What every weight quantizer returns for one layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from compress.quantizers.float_grid import FloatScheme
from compress.quantizers.grid import QuantScheme

Grid = QuantScheme | FloatScheme  # what a quantizer rounds onto: the integer grid or a float one


@dataclass
class QuantResult:
    """A quantized layer: codes and grid (for packing) plus the dequantized weight (for fake-quant).

    Shapes: ``weight`` and ``codes`` ``[out, in]``; ``scale`` and ``zero`` ``[out, n_groups]``;
    ``g_idx`` ``[in]`` maps each input column to its group (``None``: column // group_size). On a float
    grid ``codes`` are the element bit patterns and ``scheme`` carries the fitted per-tensor scale (NVFP4).
    """

    weight: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    scheme: Grid
    g_idx: torch.Tensor | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # figures (floats); a solver's also by row (tensors)


def concat_rows(parts: list[QuantResult]) -> QuantResult:
    """One layer's result from the results of its row slices, in row order (quantized apart on one grid with
    ``rows_independent``): weight, codes, scale and zero concatenated; grid and ``g_idx`` (per column) are the
    slices' own. ``stats`` is left empty: what the slices' figures add up to is the caller's to say."""
    first = parts[0]
    cat = lambda field: torch.cat([getattr(p, field) for p in parts])  # noqa: E731
    return QuantResult(cat("weight"), cat("codes"), cat("scale"), cat("zero"), first.scheme, first.g_idx)


def split_rows(result: QuantResult, rows: list[int]) -> list[QuantResult]:
    """The results of consecutive row slices of ``rows`` rows each (the inverse of `concat_rows`: several layers
    quantized stacked on one grid with ``rows_independent``): weight, codes, scale and zero split; grid and
    ``g_idx`` shared; ``stats`` left empty, as `concat_rows` leaves them."""
    parts = [getattr(result, name).split(rows) for name in ("weight", "codes", "scale", "zero")]
    return [QuantResult(*fields, result.scheme, result.g_idx) for fields in zip(*parts)]
