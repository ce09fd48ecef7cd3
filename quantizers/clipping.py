"""The clipping search of an integer grid, compiled (``csrc/clipping.c``): what `compress.quantizers.grid.mse_qparams`
runs where it can.

The torch search takes ~11 passes over the weight per candidate range (divide, round, clamp, product, difference,
``exp(norm · log|e|)``, sum), 80 candidates by default: 1.7 s for a [1536, 576] layer on one core, more than GPTQ's
own solve. Compiled, each weight is read once and its rounding error under every candidate is taken in registers,
8 candidates per AVX2 instruction (16 per AVX-512 one), the rows split between threads with the interpreter's lock
released. Of a group's candidates after the first 16 it sums only those that a bound from the group's 4 largest
weights leaves in the running, the same choice as summing all (a [3072, 576] layer, w4 g64, one thread: 154 -> 72 ms).
Its rounding errors are the torch search's bits; ``|e|**norm`` comes from polynomials within 1e-6 of torch's
``exp(norm · log|e|)``, so the two searches choose differently only where two candidates' sums lie within float32
noise of each other (a few groups in 10,000 of a real layer), where either choice is as good.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from compress.quantizers.gptq_columns import row_split
from compress.quantizers.native import compiled

SOURCE = Path(__file__).parent / "csrc" / "clipping.c"
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = (("clip_search_int", (_I64,) * 5 + (_PTR,) * 3 + (_F32, _F32, _PTR, _PTR, _I64)),)
# the search's selects compare floats; under the default -ftrapping-math a comparison may raise (on a NaN), so the
# compiler keeps each behind a branch and does not vectorize. No value changes: only exceptions nobody reads.
EXTRA_FLAGS = ("-fno-trapping-math",)


def compiled_search(w: torch.Tensor, scheme, shrinks: list[float], norm: float, extremes,
                    exhaustive: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per (row, group) the first of ``shrinks``' ranges with the smallest ``sum |w − deq(w)|**norm`` (its scale and
    zero, ``[out, n_groups]``); None where it cannot run compiled (not an integer grid with `code_bounds`, not on the
    CPU, no C compiler), and the caller searches in torch. ``exhaustive``: every candidate's sum taken in full, where
    by default the candidates after the first 16 whose errors on a group's 4 largest weights already exceed the best
    sum so far are dropped unsummed (the same choice, bit for bit: csrc/clipping.c)."""
    library = compiled(SOURCE, SIGNATURES, EXTRA_FLAGS) if w.device.type == "cpu" and scheme.code_bounds() is not None else None
    if library is None:
        return None
    low, high = extremes
    weight, width = w.float().contiguous(), scheme.group_width(w.shape[1])
    out_features, groups, count = low.shape[0], low.shape[1], len(shrinks)
    scale, zero = torch.empty_like(low), torch.empty_like(low)
    step = max(1, CANDIDATE_VALUES // (groups * count))
    factors = torch.tensor(shrinks, dtype=torch.float32)  # [candidates]
    for first in range(0, out_features, step):  # the candidates' scales and zeros a slice of rows at a time
        rows = slice(first, min(first + step, out_features))
        part = weight[rows]
        # every candidate's at once, broadcast over a last axis: the values of one `qparams` call per factor (each
        # factor is multiplied as float32 either way), without stacking 80 of them
        extremes_of_rows = (low[rows].unsqueeze(-1), high[rows].unsqueeze(-1))
        scales, zeros = (t.contiguous() for t in scheme.qparams(part, shrink=factors, extremes=extremes_of_rows))
        best = torch.empty(scales.shape[:2], dtype=torch.int64)
        with row_split(scales.shape[0]) as split:
            def run(r0: int, r1: int) -> None:
                sums = torch.empty(count)  # this run's scratch
                library.clip_search_int(r0, r1, groups, width, count, part.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                                        float(scheme.max_code), float(norm), sums.data_ptr(), best.data_ptr(), int(exhaustive))

            split(run)
        scale[rows] = scales.gather(-1, best.unsqueeze(-1)).squeeze(-1)
        zero[rows] = zeros.gather(-1, best.unsqueeze(-1)).squeeze(-1)
    return scale, zero


# candidate scales (and as many zeros) held at once: 16 MB each
CANDIDATE_VALUES = 1 << 22
