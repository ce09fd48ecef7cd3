"""The GGUF encoders' scale searches compiled (``csrc/qx_search.c``, built by `compress.quantizers.native`): the
numpy procedures' float32 operations in their order, so the same scales and bytes, several times faster on one
thread (the numpy versions run each operation over all groups and write every candidate's terms to memory)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from compress.quantizers.native import compiled

SOURCE = Path(__file__).parent / "csrc" / "qx_search.c"
_I64, _PTR, _I32, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
SIGNATURES = (  # each function's argument types (all return void)
    ("qx_scales", (_I64, _I64, _PTR, _PTR, _I32, _F32, _PTR, _PTR)),
    ("qkx2_fit", (_I64, _I64, _PTR, _PTR, _I32, _F32, _F32, _I32, _I32, _PTR, _PTR, _PTR)),
    ("qp_fit", (_I64, _I64, _PTR, _PTR, _I32, _F32, _PTR, _PTR)),
    ("q3_fit", (_I64, _I64, _PTR, _I32, _F32, _PTR, _PTR)),
)
MAX_N = 64  # values per group the compiled search takes (its tile's buffers)


def search_library():
    """The compiled searches, or None (no compiler, ``COMPRESS_NATIVE=0``): where None the numpy searches run."""
    return compiled(SOURCE, SIGNATURES)


def _prepared(x: np.ndarray):
    """The library and ``x`` as contiguous float32 groups, or (None, x) where the compiled search does not take them
    (no library, not ``[N, n]`` with ``0 < N`` and ``n <= MAX_N``): the callers then run numpy's search."""
    if x.ndim != 2 or x.shape[1] > MAX_N or x.shape[0] == 0:
        return None, x
    library = search_library()
    return library, (x if library is None else np.ascontiguousarray(x, dtype=np.float32))


def qx_scales(x: np.ndarray, nmax: int, weights: np.ndarray | None, eps: np.float32) -> tuple[np.ndarray, np.ndarray] | None:
    """`compress.formats.gguf.solvers.make_qx_quants`' search of ``x [N, n]``: each group's scale (0 where its
    largest magnitude is under ``eps``) and the inverse scale whose rounding it kept, ``[N]`` each; None where the
    compiled search is not available (no compiler, ``COMPRESS_NATIVE=0``) or the groups are too wide."""
    library, x = _prepared(x)
    if library is None:
        return None
    w = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32).reshape(x.shape)
    scale, chosen = np.empty(x.shape[0], dtype=np.float32), np.empty(x.shape[0], dtype=np.float32)
    library.qx_scales(x.shape[0], x.shape[1], x.ctypes.data, None if w is None else w.ctypes.data, nmax, float(eps),
                      scale.ctypes.data, chosen.ctypes.data)
    return scale, chosen


def qkx2_fit(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
             use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`compress.formats.gguf.solvers.make_qkx2_quants` of ``x`` and weights ``w`` ``[N, n]``: (scale ``[N]``, min
    ``[N]``, codes ``[N, n]`` int32), or None where the compiled search is not available or the groups are too wide."""
    library, x = _prepared(x)
    if library is None:
        return None
    w = np.ascontiguousarray(w, dtype=np.float32).reshape(x.shape)
    scale, low = np.empty(x.shape[0], dtype=np.float32), np.empty(x.shape[0], dtype=np.float32)
    codes = np.empty(x.shape, dtype=np.int32)
    library.qkx2_fit(x.shape[0], x.shape[1], x.ctypes.data, w.ctypes.data, nmax, rmin, rdelta, nstep, int(use_mad),
                     scale.ctypes.data, low.ctypes.data, codes.ctypes.data)
    return scale, low, codes


def qp_fit(x: np.ndarray, nmax: int, w: np.ndarray, eps: np.float32) -> tuple[np.ndarray, np.ndarray] | None:
    """`compress.formats.gguf.solvers.make_qp_quants` of ``x`` and weights ``w`` ``[N, n]``: (scale ``[N]``, codes
    ``[N, n]`` int32), or None where the compiled search is not available or the groups are too wide."""
    library, x = _prepared(x)
    if library is None:
        return None
    w = np.ascontiguousarray(w, dtype=np.float32).reshape(x.shape)
    scale, codes = np.empty(x.shape[0], dtype=np.float32), np.empty(x.shape, dtype=np.int32)
    library.qp_fit(x.shape[0], x.shape[1], x.ctypes.data, w.ctypes.data, nmax, float(eps), scale.ctypes.data,
                   codes.ctypes.data)
    return scale, codes


def q3_fit(x: np.ndarray, nmax: int, eps: np.float32) -> tuple[np.ndarray, np.ndarray] | None:
    """`compress.formats.gguf.solvers.make_q3_quants` of ``x [N, n]``: (scale ``[N]``, codes ``[N, n]`` int32), or
    None where the compiled search is not available or the groups are too wide."""
    library, x = _prepared(x)
    if library is None:
        return None
    scale, codes = np.empty(x.shape[0], dtype=np.float32), np.empty(x.shape, dtype=np.int32)
    library.q3_fit(x.shape[0], x.shape[1], x.ctypes.data, nmax, float(eps), scale.ctypes.data, codes.ctypes.data)
    return scale, codes
