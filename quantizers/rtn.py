"""Round-to-nearest (RTN): the baseline every calibrated quantizer is measured against.

Each (row, group) of ``W [out, in]`` is mapped to its own min-max grid (see ``grid``; or the scales of a
float grid, see ``float_grid``) and rounded to the nearest code, independently of every other weight and
of any data. Objective: none beyond the per-weight rounding error; ``stats`` reports the relative Frobenius error ‖W − Q‖ / ‖W‖.
"""

from __future__ import annotations

import torch

from compress.quantizers.result import Grid, QuantResult


def rtn(weight: torch.Tensor, scheme: Grid, shrink: float | torch.Tensor = 1.0) -> QuantResult:
    """Quantize ``weight [out, in]`` to ``scheme`` by rounding to nearest. Does not modify ``weight``.

    ``shrink`` (scalar or ``[out, n_groups]``, <= 1) narrows each group's range first: values beyond it
    clip to the extreme codes (AWQ's searched clipping)."""
    w = weight.float()
    scheme = scheme.fit(w)
    scale, zero = scheme.qparams(w, shrink)
    codes = scheme.quantize(w, scale, zero)
    deq = scheme.dequantize(codes, scale, zero)
    norm = torch.linalg.norm(w).item()
    rel_err = torch.linalg.norm(w - deq).item() / norm if norm > 0 else 0.0
    return QuantResult(deq, codes, scale, zero, scheme, stats={"weight_rel_error": rel_err})
