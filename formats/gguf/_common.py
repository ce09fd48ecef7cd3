"""Shared pieces of the GGUF block codecs: float16 fields, rounding, and ggml's scale solvers.

The solvers follow ggml's reference quantizers (``ggml/src/ggml-quants.c``: ``make_qkx2_quants``,
``make_qx_quants``, ``make_q3_quants``, ``nearest_int``), vectorised over many independent groups:
``x`` has shape ``[N, n]`` (N groups of n weights) and everything is float32 as in the C code, with
the sums that decide between candidate grids taken left to right as ggml's loops do (`_running_sum`):
with numpy's pairwise sums a few percent of Q4_K blocks came out different from ggml's. With that, the
encoders write ggml's bytes (tests/formats/gguf/test_ggml_reference.py). The importance-weighted
variants (``make_qkx3_quants`` is `make_qkx2_quants` with other step settings; `make_qp_quants`) serve
llama.cpp's imatrix mode.
"""

from __future__ import annotations

import numpy as np

# ggml's GROUP_MAX_EPS: a group whose largest |x| is below this is all zeros.
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32


def nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even in float32 (the 1.5·2^23 trick), as int32."""
    return np.rint(x.astype(F32, copy=False)).astype(np.int32)


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


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """The entry of largest magnitude in each row, with its sign (first one on ties), ``[N, 1]``."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, idx, axis=-1)


def _levels(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``clamp(nearest_int(v), lo, hi)`` kept in float32 (rint rounds half to even like ggml)."""
    return np.clip(np.rint(v), lo, hi, out=np.empty_like(v))


def _running_sum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0 left to right in float32, the order of ggml's scalar loops (``[n, N] -> [N]``);
    numpy's pairwise sum differs in the last bit, enough to flip near-ties between candidate grids."""
    acc = a[0].copy()
    for row in a[1:]:
        acc += row
    return acc


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric ``x ≈ scale·L − min`` with L in [0, nmax], minimising Σ w·err (err² or |err|).

    Tries ``nstep+1`` inverse scales ``(nmax + rmin + rdelta·i)/(max − min)`` and refits scale and min
    by weighted least squares for each; as in ggml, ``min`` is the best fit's so far, so the candidates
    depend on the order they are tried in. Returns (scale [N], min [N] (≥ 0, subtracted), L [N, n]).
    Works on transposed ``[n, N]`` copies so the running sums walk contiguous rows.
    """
    x = np.ascontiguousarray(x.astype(F32, copy=False).T)
    w = np.ascontiguousarray(w.astype(F32, copy=False).T)
    lo = np.minimum(x.min(axis=0), F32(0))
    hi = x.max(axis=0)
    flat = hi == lo
    sum_w = _running_sum(w)
    sum_x = _running_sum(w * x)

    def error(scale, offset, levels):
        diff = scale * levels + offset - x
        return _running_sum(w * (np.abs(diff) if use_mad else diff * diff))

    iscale = F32(nmax) / np.where(flat, F32(1), hi - lo)
    levels = np.clip(np.rint(iscale * (x - lo)), 0, nmax)
    scale = F32(1) / iscale
    best = error(scale, lo, levels)
    offset = lo.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / np.where(flat, F32(1), hi - offset)
            trial = np.clip(np.rint(iscale * (x - offset)), 0, nmax)
            wl = w * trial
            sum_l = _running_sum(wl)
            sum_l2 = _running_sum(wl * trial)
            sum_xl = _running_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, F32(0), this_min)
            cur = error(this_scale, this_min, trial)
            better = (det > 0) & (cur < best)
            levels = np.where(better, trial, levels)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            offset = np.where(better, this_min, offset)
    scale = np.where(flat, F32(0), scale).astype(F32)
    levels = np.where(flat, F32(0), levels)
    return scale, (-offset).astype(F32), np.ascontiguousarray(levels.T).astype(np.int32)


def make_qx_quants(x: np.ndarray, nmax: int, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric ``x ≈ scale·L``, L in [−nmax, nmax−1]; ggml's ``make_qx_quants`` with rmse_type 1.

    Weights default to x² (rmse_type 1). Searches 18 inverse scales ``−(nmax + 0.1·i)/max`` around
    the plain one and keeps the least-squares scale of the best. Returns scale ``[N]`` (signed) and
    the codes ``L + nmax`` of the chosen rounding ``[N, n]`` (all 0 for an all-zero group).
    """
    x = x.astype(F32, copy=False)
    w = x * x if weights is None else weights.astype(F32, copy=False)
    top = signed_absmax(x)[:, 0]
    empty = np.abs(top) < GROUP_MAX_EPS
    top = np.where(empty, F32(1), top)

    xt, wt = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)

    def fit(iscale):
        levels = np.clip(np.rint(iscale * xt), -nmax, nmax - 1)
        wx = wt * xt
        return _running_sum(wx * levels), _running_sum(wt * levels * levels)

    chosen = F32(-nmax) / top
    sumlx, suml2 = fit(chosen)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / top
            slx, sl2 = fit(iscale)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            scale = np.where(better, slx / sl2, scale)
            best = np.where(better, scale * slx, best)
            chosen = np.where(better, iscale, chosen)
    codes = np.clip(nearest_int(chosen[:, None] * x), -nmax, nmax - 1) + nmax
    return np.where(empty, F32(0), scale).astype(F32), np.where(empty[:, None], 0, codes)


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric ``x ≈ scale·L``, L in [−nmax, nmax−1]: ggml's ``make_q3_quants`` with do_rmse.

    Starts from plain rounding at ``−nmax/max`` and makes up to 5 passes of coordinate descent on
    the x²-weighted least-squares fit, element by element. Returns scale ``[N]`` (signed) and the
    codes ``L + nmax`` ``[N, n]`` (all 0 for an all-zero group).
    """
    x = x.astype(F32, copy=False)
    top = signed_absmax(x)[:, 0]
    empty = np.abs(top) < GROUP_MAX_EPS
    iscale = F32(-nmax) / np.where(empty, F32(1), top)
    levels = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(F32)
    w = x * x
    sumlx = _running_sum(np.ascontiguousarray((w * x * levels).T))
    suml2 = _running_sum(np.ascontiguousarray((w * levels * levels).T))
    active = ~empty
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(5):
            changed = np.zeros(x.shape[0], dtype=bool)
            for i in range(x.shape[1]):
                xi, wi, li = x[:, i], w[:, i], levels[:, i]
                slx = sumlx - wi * xi * li
                sl2 = suml2 - wi * li * li
                new = np.clip(nearest_int(xi * sl2 / slx), -nmax, nmax - 1).astype(F32)
                slx_new = slx + wi * xi * new
                sl2_new = sl2 + wi * new * new
                take = (active & (slx > 0) & (new != li) & (sl2_new > 0)
                        & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
                levels[:, i] = np.where(take, new, li)
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
                changed |= take
            active &= changed
            if not active.any():
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    codes = np.where(empty[:, None], 0, levels.astype(np.int32) + nmax)
    return np.where(empty, F32(0), scale).astype(F32), codes


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


def make_qp_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned ``x ≈ scale·L``, L in [0, nmax], w-weighted: ggml's ``make_qp_quants``.

    Used to quantize a super-block's sub-block scales (x ≥ 0) with the sub-blocks' total importance as
    weights: 8 trial inverse scales ``(nmax + 0.1·i)/max`` around the plain one, then up to 5 passes of
    coordinate descent on the weighted least-squares fit. Returns (scale [N], L [N, n] int32).
    """
    x = x.astype(F32, copy=False)
    w = w.astype(F32, copy=False)
    top = np.maximum(x.max(axis=1), F32(0))
    empty = top < GROUP_MAX_EPS
    top = np.where(empty, F32(1), top)
    xt, wt = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)

    def mse(iscale, clamp):
        levels = np.rint(iscale * xt)
        levels = np.minimum(levels, nmax) if clamp else levels
        diff = xt - (F32(1) / iscale) * levels
        return _running_sum(wt * diff * diff)

    chosen = F32(nmax) / top
    best = mse(chosen, clamp=False)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale = (F32(0.1) * F32(step) + F32(nmax)) / top
        cur = mse(iscale, clamp=True)
        better = cur < best
        best = np.where(better, cur, best)
        chosen = np.where(better, iscale, chosen)
    levels = np.minimum(np.rint(chosen * xt), nmax)
    sumlx = _running_sum(wt * xt * levels)
    suml2 = _running_sum(wt * levels * levels)
    active = ~empty
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(5):
            changed = np.zeros(x.shape[0], dtype=bool)
            for i in range(x.shape[1]):
                xi, wi, li = xt[i], wt[i], levels[i]
                slx = sumlx - wi * xi * li
                sl2 = suml2 - wi * li * li
                new = np.minimum(np.rint(xi * sl2 / slx), nmax)
                slx_new = slx + wi * xi * new
                sl2_new = sl2 + wi * new * new
                take = (active & (slx > 0) & (sl2 > 0) & (new != li)
                        & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
                levels[i] = np.where(take, new, li)
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
                changed |= take
            active &= changed
            if not active.any():
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    codes = np.where(empty[:, None], 0, levels.T.astype(np.int32))
    return np.where(empty, F32(0), scale).astype(F32), codes


def importance_weights(x: np.ndarray, qw: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """ggml's per-weight error weights with an importance matrix: ``qw·sqrt(σ² + x²)`` (float32)."""
    return (qw * np.sqrt(sigma2 + x * x)).astype(F32)


def mean_square(x: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """``factor·Σx²/n`` over each row in ggml's left-to-right float32 order, ``[N, 1]``."""
    return (F32(factor) * _running_sum(np.ascontiguousarray((x * x).T)) / F32(x.shape[1]))[:, None]
