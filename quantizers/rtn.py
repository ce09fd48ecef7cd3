"""Round-to-nearest (RTN): the baseline every calibrated quantizer is measured against.

Each (row, group) of ``W [out, in]`` is mapped to its own min-max grid (see ``grid``; or the scales of a
float grid, see ``float_grid``) and rounded to the nearest code, independently of every other weight and
of any data. Objective: none beyond the per-weight rounding error; ``stats`` reports the relative Frobenius error ‖W − Q‖ / ‖W‖.
On the CPU an integer grid runs compiled (``csrc/rtn.c``, one pass over the weight instead of torch's ~11): the same bits.
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import torch

from compress.quantizers import pages
from compress.quantizers.gptq_columns import row_split
from compress.quantizers.native import compiled
from compress.quantizers.result import Grid, QuantResult

# Weights per slice of rows on a grid whose rows are independent: each step's temporaries (a few MB) stay in the
# cache and are reused by the allocator, where a whole 14336 x 4096 layer made six fresh 235 MB ones (0.44 -> 0.26 s).
SLICE_ELEMENTS = 1 << 20


def rtn(weight: torch.Tensor, scheme: Grid, shrink: float | torch.Tensor = 1.0, *, overwrite: bool = False) -> QuantResult:
    """Quantize ``weight [out, in]`` to ``scheme`` by rounding to nearest. Does not modify ``weight`` unless asked.

    ``shrink`` (scalar or ``[out, n_groups]``, <= 1) narrows each group's range first: values beyond it
    clip to the extreme codes (AWQ's searched clipping). ``weight`` may be float32, bfloat16 or float16: the result is
    that of its float32 copy, except where it runs compiled (``csrc/rtn.c``: an integer grid on the CPU), whose codes
    are uint8 and whose values are in ``weight``'s dtype (a bfloat16 weight's: the float32 values rounded to it).
    ``overwrite``: the values are written over ``weight``, in its dtype, and the result's weight is ``weight`` itself:
    for a caller that transforms its layer in place, with no second tensor of the layer's size."""
    library = _library(weight, scheme)
    if library is not None:  # an integer grid: nothing to fit to the whole tensor
        return _compiled_rtn(library, weight, scheme, shrink, overwrite)
    result = _torch_rtn(weight, scheme, shrink)
    if overwrite:
        weight.copy_(result.weight)
        result = dataclasses.replace(result, weight=weight)
    return result


def _torch_rtn(weight: torch.Tensor, scheme: Grid, shrink: float | torch.Tensor) -> QuantResult:
    """`rtn` by torch's operations on the float32 copy of ``weight``, a slice of rows at a time where rows are independent."""
    w = weight.float()
    scheme = scheme.fit(w)
    rows = max(1, SLICE_ELEMENTS // max(w.shape[1], 1)) if scheme.rows_independent else w.shape[0]
    out: list[torch.Tensor] = []  # weight, codes, scale, zero of all rows, allocated from the first slice's
    energy = error = 0.0
    for start in range(0, max(w.shape[0], 1), rows):  # an empty weight: one empty slice
        part, stop = w[start : start + rows], min(start + rows, w.shape[0])
        part_shrink = shrink[start:stop] if isinstance(shrink, torch.Tensor) and shrink.dim() > 0 else shrink
        scale, zero = scheme.qparams(part, part_shrink)
        codes = scheme.quantize(part, scale, zero)
        deq = scheme.dequantize(codes, scale, zero)
        energy += float(torch.linalg.vector_norm(part)) ** 2
        error += float(torch.linalg.vector_norm(part - deq)) ** 2
        if rows >= w.shape[0]:
            out = [deq, codes, scale, zero]
            break
        if not out:
            out = [t.new_empty((w.shape[0], *t.shape[1:])) for t in (deq, codes, scale, zero)]
        for whole, piece in zip(out, (deq, codes, scale, zero)):
            whole[start:stop] = piece
    rel_err = (error / energy) ** 0.5 if energy > 0 else 0.0
    return QuantResult(*out, scheme, stats={"weight_rel_error": rel_err})


SOURCE = Path(__file__).parent / "csrc" / "rtn.c"
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = (*((name, (_I64,) * 4 + (_PTR,) * 3 + (_F32,) + (_PTR,) * 4) for name in ("rtn_int", "rtn_int_bf16")),
              *((name, (_I64,) * 4 + (_PTR,) * 3) for name in ("extremes", "extremes_bf16")))
# the weight's dtype read by each loop: rounding, extremes
_ENTRY = {torch.float32: ("rtn_int", "extremes"), torch.bfloat16: ("rtn_int_bf16", "extremes_bf16")}
EXTRA_FLAGS = ("-fno-trapping-math",)  # the clamps' selects vectorize (see `compress.quantizers.clipping`)


def _library(w: torch.Tensor, scheme: Grid):
    """The compiled loop (``csrc/rtn.c``) where it runs: an integer grid, a float32 or bfloat16 CPU weight with values;
    else None."""
    usable = w.device.type == "cpu" and w.dtype in _ENTRY and w.dim() == 2 and w.numel() > 0 and scheme.code_bounds() is not None
    return compiled(SOURCE, SIGNATURES, EXTRA_FLAGS) if usable else None


def _compiled_rtn(library, weight: torch.Tensor, scheme: Grid, shrink: float | torch.Tensor, overwrite: bool) -> QuantResult:
    """`rtn`'s codes and values in one compiled pass over the weight, its rows cut between torch's threads: the torch
    loop's bits (the same grid from `scheme.qparams`, the same operations), the error figure summed in float64. A
    bfloat16 weight is widened inside the loop (exactly: its bits are a float32's upper half) and its values rounded
    to bfloat16, what the engine's bfloat16 block holds (set_weight's conversion); the codes are bytes."""
    w = weight.contiguous()
    rounding, extremes = (getattr(library, name) for name in _ENTRY[w.dtype])
    out, groups, width = w.shape[0], scheme.groups(w.shape[1]), scheme.group_width(w.shape[1])
    low, high = torch.empty(out, groups), torch.empty(out, groups)  # `grid.group_extremes` in one pass, not two
    codes = pages.empty(w.shape, torch.uint8)  # written once, in full
    values = w if overwrite else pages.empty(w.shape, w.dtype)  # the loop reads each strip of w before writing it
    energy, error = torch.empty(out, dtype=torch.float64), torch.empty(out, dtype=torch.float64)
    with row_split(out) as split:
        split(lambda r0, r1: extremes(r0, r1, groups, width, w.data_ptr(), low.data_ptr(), high.data_ptr()))
        scale, zero = scheme.qparams(w, shrink, extremes=(low, high))
        scale, zero = scale.contiguous(), zero.contiguous()
        pointers = [t.data_ptr() for t in (w, scale, zero)]
        results = [t.data_ptr() for t in (codes, values, energy, error)]
        split(lambda r0, r1: rounding(r0, r1, groups, width, *pointers, float(scheme.max_code), *results))
    if overwrite and values is not weight:  # a weight whose rows are not contiguous was copied
        values = weight.copy_(values)
    total = float(energy.sum())
    rel_err = (float(error.sum()) / total) ** 0.5 if total > 0 else 0.0
    return QuantResult(values, codes, scale, zero, scheme, stats={"weight_rel_error": rel_err})
