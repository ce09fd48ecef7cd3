"""The upper triangle of bfloat16 windows' Gram matrix, compiled (``csrc/gram.c``), where the CPU multiplies bfloat16
pairs (AVX512-BF16).

``add_upper_gram_bf16_(total, windows, packed)`` adds ``Σ_t x_t x_tᵀ`` of each window ``x [tokens, in]`` of
``windows [count, tokens, in]`` (bfloat16) to the float64 ``total [in, in]``, on and above its diagonal: each
window's sums in float32 from exact products, added window by window, as the statistics' float32 products of the
same values (`compress.engine.statistics.add_upper_gram_`), with no float32 copy of the input and at about twice
the float32 product's rate. Only the order of each window's float32 sum differs from torch's, so the entries agree to
float32 rounding, not bit for bit; they are the same whatever the thread count and however the windows are batched.
`usable` says where it runs: a CPU with the instructions, a contiguous bfloat16 input whose width is a multiple of
`PANEL`, the compiled library built (``COMPRESS_NATIVE=0`` asks for torch's products everywhere).
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

from compress.quantizers.native import compiled
from compress.quantizers.threads import even_runs, share_runs

SOURCE = Path(__file__).parent / "csrc" / "gram.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = (("gram_pack", (_I64,) * 4 + (_PTR,) * 2), ("gram_bf16_upper", (_I64,) * 5 + (_PTR,) * 2))
PANEL = 32  # the compiled tiles' columns (NR of csrc/gram.c): the width must be a multiple
MIN_PACK_PAIRS = 64  # pair rows below which packing them on a second thread costs more than it saves


def _library():
    library = compiled(SOURCE, SIGNATURES)
    return library if library is not None and _supported(library) else None


@functools.cache
def _supported(library) -> bool:
    return bool(library.gram_bf16_supported())


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has AVX512-BF16's pair products (and this library is built to ask it): what every compiled
    bfloat16 loop needs (`compress.kernels.cpu_attention` asks here too)."""
    return _library() is not None


def usable(total: torch.Tensor, windows: torch.Tensor) -> bool:
    """Whether `add_upper_gram_bf16_` runs for these tensors on this machine."""
    width = windows.shape[-1]
    return (windows.device.type == "cpu" and windows.dtype == torch.bfloat16 and windows.dim() == 3
            and windows.is_contiguous() and width % PANEL == 0 and total.dtype == torch.float64
            and total.is_contiguous() and total.shape == (width, width) and windows.shape[1] > 0
            and _library() is not None)


def packed_shape(windows: torch.Tensor) -> tuple[int, int]:
    """The shape of `add_upper_gram_bf16_`'s ``packed`` buffer (int32) for ``windows``."""
    count, tokens, width = windows.shape
    return count * ((tokens + 1) // 2), width


def add_upper_gram_bf16_(total: torch.Tensor, windows: torch.Tensor, packed: torch.Tensor) -> None:
    """``total += Σ_w x_wᵀx_w`` on and above the diagonal (see the module; `usable` must hold); ``packed``: an int32
    buffer of `packed_shape`, overwritten (the windows' token pairs side by side, as the instruction reads them)."""
    library = _library()
    count, tokens, width = windows.shape
    pairs, panels = (tokens + 1) // 2, width // PANEL
    threads = max(1, torch.get_num_threads())
    x, p, out = windows.data_ptr(), packed.data_ptr(), total.data_ptr()
    rows = count * pairs
    pack_parts = min(threads, max(1, rows // MIN_PACK_PAIRS))
    with ThreadPoolExecutor(threads - 1) if threads > 1 else nullcontext() as pool:
        share_runs(pool, lambda a, b: library.gram_pack(a, b, tokens, width, x, p), even_runs(rows, pack_parts))
        share_runs(pool, lambda a, b: library.gram_bf16_upper(a, b, count, pairs, width, p, out), balanced_panels(panels, threads))


def balanced_panels(panels: int, parts: int) -> list[tuple[int, int]]:
    """``[0, panels)`` cut into up to ``parts`` runs of about equal work: panel ``q`` covers ``q + 1`` panels' worth
    of rows (the triangle's), so the later runs are shorter."""
    total = panels * (panels + 1) // 2
    cuts, done, start = [], 0, 0
    for q in range(panels):
        done += q + 1
        if done * parts >= total * (len(cuts) + 1) and len(cuts) < parts - 1:
            cuts.append((start, q + 1))
            start = q + 1
    cuts.append((start, panels))
    return [run for run in cuts if run[0] < run[1]]
