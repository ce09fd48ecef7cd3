"""Shared pieces of the GGUF block codecs: float16 fields, ggml's rounding (``nearest_int``), sums in ggml's
left-to-right float32 order (`_running_sum`: with numpy's pairwise sums a few percent of Q4_K blocks came out
different from ggml's), the k-quants' 6-bit scale packing, and the importance weights of llama.cpp's imatrix mode.
ggml's scale solvers that use them are in `compress.formats.gguf.solvers`.
"""

from __future__ import annotations

import numpy as np
import torch


# ggml's GROUP_MAX_EPS: a group whose largest |x| is below this is all zeros.
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32


def nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even in float32 (the 1.5·2^23 trick), as int32."""
    return np.rint(x.astype(F32, copy=False)).astype(np.int32)


def round_half_away_(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (half away from zero) of float32 ``v``, in place. torch rounds half to even; the two differ only
    where ``v − round(v)`` is exactly ±0.5 on the side away from zero (``v − round(v)`` is always exact), and there
    the result moves one step outwards. Every step is one vectorised pass: ``trunc(v) + trunc(2·frac(v))``, exact
    too, ran 3-4x slower (torch's trunc is scalar code on CPU), and ``floor(|v| + 0.5)`` misrounds 0.49999997."""
    rounded = v.round()
    sign = v.sign()
    tie = v.sub_(rounded).mul_(sign).eq_(0.5)  # v's storage now holds the flags (1.0 / 0.0)
    return rounded.add_(tie.mul_(sign))


def float32_of(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x`` as float32 (in ``out`` if given, else a new array unless it already is float32). Float16 goes through
    torch's vectorised conversion: exact, as numpy's, and ~10x faster (0.18 vs 1.7-2.1 ns a weight here), which
    counts beside Q8_0's ~1 ns of encoding and in the export's hand-over to its workers."""
    if x.dtype != np.float16:
        if out is None:
            return x.astype(F32, copy=False)
        np.copyto(out, x, casting="same_kind")
        return out
    out = np.empty(x.shape, dtype=F32) if out is None else out
    if not (x.flags.c_contiguous and x.flags.writeable):
        # torch takes no negative strides, and warns on a read-only array (a memory-mapped file's); copying the
        # float16 (~0.05 ns a weight) avoids both without `warnings.catch_warnings`, which threads must not share
        x = np.array(x, order="C")
    torch.from_numpy(out).copy_(torch.from_numpy(x))
    return out


def fp16_round(x: np.ndarray) -> np.ndarray:
    """The float32 value a float16 field stores (``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x))``)."""
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def fp16_bytes(x: np.ndarray) -> np.ndarray:
    """``[N]`` float32 -> ``[N, 2]`` uint8 little-endian float16."""
    return np.asarray(x, dtype=F32).astype("<f2").reshape(-1, 1).view(np.uint8)


def fp16_field(data: np.ndarray, start: int) -> np.ndarray:
    """Read the float16 at byte ``start`` of every ``[N, bytes]`` row, as float32 ``[N, 1]``."""
    return np.ascontiguousarray(data[:, start : start + 2]).view("<f2").astype(F32)


def safe_reciprocal(x: np.ndarray) -> np.ndarray:
    """``1/x`` where x != 0, else 0 (ggml's ``id = d ? 1.0f/d : 0.0f``)."""
    with np.errstate(divide="ignore"):
        return np.where(x == 0, F32(0), F32(1) / np.where(x == 0, F32(1), x)).astype(F32)


def as_torch(x: np.ndarray) -> torch.Tensor:
    """A float32 torch view of ``x`` (copied only if not already contiguous float32)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=F32))


def row_max(x: np.ndarray) -> np.ndarray:
    """Largest entry of each row ``[..., 1]`` (torch's row reductions are several times numpy's)."""
    return as_torch(x).amax(-1, keepdim=True).numpy()


def row_min(x: np.ndarray) -> np.ndarray:
    return as_torch(x).amin(-1, keepdim=True).numpy()


def signed_absmax(x: np.ndarray, columns: np.ndarray | None = None) -> np.ndarray:
    """The entry of largest magnitude in each row of ``x [N, n]``, with its sign (first one on ties; +0
    for a zero row, as ggml's ``if (amax < ax)`` loops): ``[N, 1]``, or ``[N]`` given ``columns``, the
    contiguous transpose ``[n, N]`` (then the maxima are numpy's fast reductions over rows)."""
    if columns is not None:
        hi, lo = columns.max(axis=0), columns.min(axis=0)
    else:
        hi, lo = row_max(x), row_min(x)
    top = np.where(hi >= -lo, hi, lo) + F32(0)  # + 0 turns −0 into +0, nothing else
    tie = np.flatnonzero((hi == -lo) & (hi > 0))
    if tie.size:  # both +a and −a: whichever comes first
        rows = np.ascontiguousarray(x, dtype=F32).reshape(-1, x.shape[-1])[tie]
        top.reshape(-1)[tie] = rows[np.arange(tie.size), np.abs(rows).argmax(axis=1)]
    return top


def _running_sum(a: np.ndarray, axis: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """Sum over ``axis`` left to right in float32, the order of ggml's scalar loops (``[n, N] -> [N]``);
    numpy's pairwise sum differs in the last bit, enough to flip near-ties between candidate grids.
    numpy reduces a C-contiguous array over an axis that is not the last one slice by slice (a vector
    add per slice); it sums pairwise only along the contiguous axis, i.e. when the slices are single values."""
    if a.flags.c_contiguous and axis < a.ndim - 1 and a.shape[-1] > 1:
        return np.add.reduce(a, axis=axis, out=out)
    a = np.moveaxis(a, axis, 0)
    acc = a[0].copy()
    for row in a[1:]:
        acc += row
    if out is not None:
        out[...] = acc
    return acc


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins ``[N, 8]`` into ggml's 12 bytes (``get_scale_min_k4``)."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def unpack_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `pack_k_scales`: ``[N, 12]`` bytes -> (scales, mins), each ``[N, 8]`` uint8."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, m


def nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two arrays of 4-bit codes -> one byte each: ``lo | hi << 4``."""
    return (lo.astype(np.uint8) & 15) | (hi.astype(np.uint8) << 4)


def importance_weights(x: np.ndarray, qw: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """ggml's per-weight error weights with an importance matrix: ``qw·sqrt(σ² + x²)`` (float32)."""
    return (qw * np.sqrt(sigma2 + x * x)).astype(F32)


def mean_square(x: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """``factor·Σx²/n`` over each row in ggml's left-to-right float32 order, ``[N, 1]``."""
    return (F32(factor) * _running_sum(np.ascontiguousarray((x * x).T)) / F32(x.shape[1]))[:, None]
