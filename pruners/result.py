"""What every pruner returns for one layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compress.quantizers.result import QuantResult


@dataclass
class PruneResult:
    """A pruned layer: the new weight and the mask of pruned weights (both ``[out, in]``).

    ``weight`` is float32 with exact zeros where ``pruned`` is True; ``quant`` holds the grid and codes
    when the pruner also quantized the kept weights (SparseGPT's joint mode), else None.
    """

    weight: torch.Tensor
    pruned: torch.Tensor
    quant: QuantResult | None = None
    stats: dict[str, float] = field(default_factory=dict)
