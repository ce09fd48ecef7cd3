"""ggml's scale solvers for the GGUF block codecs, vectorised over many independent groups.

They follow ggml's reference quantizers (``ggml/src/ggml-quants.c``: ``make_qkx2_quants``, ``make_qx_quants``,
``make_q3_quants``, ``make_qp_quants``): ``x`` has shape ``[N, n]`` (N groups of n weights) and everything is float32
as in the C code, with the sums that decide between candidate grids taken left to right as ggml's loops do
(`compress.formats.gguf._common._running_sum`). With that, the encoders write ggml's bytes
(tests/formats/gguf/test_ggml_reference.py). The importance-weighted variants (``make_qkx3_quants`` is
`make_qkx2_quants` with other step settings; `make_qp_quants`) serve llama.cpp's imatrix mode. Each runs compiled
where it can (`compress.formats.gguf.native_search`, the same bits), else as here.

Speed: the solvers hold the groups transposed, ``[n, N]``, so a sum over a group is one numpy reduction over rows
(in ggml's order); their elementwise passes run in torch, in place (about twice numpy's speed at one thread, and
every op is one IEEE float32 operation, as numpy's: no fused multiply-add, which would round differently), and
torch's row maxima replace numpy's slow short-row reductions.
"""

from __future__ import annotations

import numpy as np
import torch

from compress.formats.gguf._common import F32, GROUP_MAX_EPS, _running_sum, as_torch, signed_absmax
from compress.formats.gguf.native_search import q3_fit, qkx2_fit, qp_fit, qx_scales

# `make_qx_quants`' trials rounded and summed together: 3 of its 19 keep a 128K-weight chunk's temporaries (~4.5 MB)
# near the cache and cut the call count (Q6_K, one thread, 2816 x 2048 F16, MB/s at 64K- / 128K-weight chunks:
# 2 at once 52-56 / 64-65, 3 at once 57-59 / 67, 5 at once 59-60 / 62-65, 7 at once 59-60 / 56-60)
QX_TRIALS_AT_ONCE = 3


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric ``x ≈ scale·L − min`` with L in [0, nmax], minimising Σ w·err (err² or |err|).

    Tries ``nstep+1`` inverse scales ``(nmax + rmin + rdelta·i)/(max − min)`` and refits scale and min
    by weighted least squares for each; as in ggml, ``min`` is the best fit's so far, so the candidates
    depend on the order they are tried in. Returns (scale [N], min [N] (≥ 0, subtracted), L [N, n]).
    The weights sit transposed, ``[n, N]``, so each sum is one numpy reduction over rows (`_running_sum`);
    the elementwise work runs in place in torch (faster than numpy at one thread), the per-group
    bookkeeping in numpy, and the winner's rounding is redone once at the end from its (iscale, min). Compiled where
    it can be (`native_search.qkx2_fit`: the same bits).
    """
    found = qkx2_fit(x, w, nmax, rmin, rdelta, nstep, use_mad)
    if found is not None:
        return found
    n, groups = x.shape[1], x.shape[0]
    lx = np.empty((2, n, groups), dtype=F32)  # [L, x]: w·L times this gives w·L², w·L·x in one op
    lx[1] = x.T
    x, w = lx[1], np.ascontiguousarray(w.astype(F32, copy=False).T)
    lo = x.min(axis=0)
    lo = np.where(lo > 0, F32(0), lo)  # ggml's ``if (min > 0) min = 0``: a −0 min stays −0
    hi = x.max(axis=0)
    flat = hi == lo
    # any non-zero span serves a flat group (its codes are all 0 whatever the scale; ggml skips it)
    top = np.where(flat, lo + F32(1), hi)
    terms = np.empty((3, n, groups), dtype=F32)  # per weight: w·L, w·L², w·L·x
    terms[0] = w
    np.multiply(w, x, out=terms[1])
    sum_w, sum_x = _running_sum(terms[:2], axis=1)
    lx_t, terms_t = torch.from_numpy(lx), torch.from_numpy(terms)
    levels, xt, wt = lx_t[0], lx_t[1], torch.from_numpy(w)
    wl, wl_times = terms_t[0], terms_t[1:]

    def round_levels(iscale, offset):  # torch [N] rows -> levels [n, N]
        return torch.sub(xt, offset, out=levels).mul_(iscale).round_().clamp_(0, nmax)

    def error(scale, offset, out):  # (the w·L row is free by now)
        d = torch.mul(levels, scale, out=wl).add_(offset).sub_(xt)
        d.abs_() if use_mad else d.mul_(d)
        return _running_sum(d.mul_(wt).numpy(), out=out)

    # the search state, overwritten where a trial wins: its inverse scale and the min it rounded with,
    # its error, the fitted scale and the fitted min (the min the next trials round with)
    state = np.empty((5, groups), dtype=F32)
    trial = np.empty_like(state)
    best_iscale, best_offset, best, scale, offset = state
    iscale, used_offset, cur, this_scale, this_min = trial
    iscale_t, used_offset_t, _, this_scale_t, this_min_t = torch.from_numpy(trial)
    np.divide(F32(nmax), top - lo, out=iscale)
    used_offset[...] = lo
    np.divide(F32(1), iscale, out=this_scale)
    this_min[...] = lo
    round_levels(iscale_t, used_offset_t)
    error(this_scale_t, used_offset_t, out=cur)
    state[...] = trial
    sums = np.empty((3, groups), dtype=F32)
    sum_l, sum_l2, sum_xl = sums
    numerators = [F32(rmin) + F32(rdelta) * F32(step) + F32(nmax) for step in range(nstep + 1)]  # of the trial iscales
    with np.errstate(divide="ignore", invalid="ignore"):
        for numerator in numerators:
            np.subtract(top, offset, out=iscale)
            np.divide(numerator, iscale, out=iscale)
            np.copyto(used_offset, offset)
            round_levels(iscale_t, used_offset_t)
            torch.mul(wt, levels, out=wl)
            torch.mul(wl, lx_t, out=wl_times)
            _running_sum(terms, axis=1, out=sums)
            det = sum_w * sum_l2 - sum_l * sum_l
            np.divide(sum_w * sum_xl - sum_x * sum_l, det, out=this_scale)
            np.divide(sum_l2 * sum_x - sum_l * sum_xl, det, out=this_min)
            positive = this_min > 0
            np.divide(sum_xl, sum_l2, out=this_scale, where=positive)
            np.copyto(this_min, F32(0), where=positive)
            error(this_scale_t, this_min_t, out=cur)
            np.copyto(state, trial, where=(det > 0) & (cur < best))  # each group's column of the 5 rows
    codes = round_levels(torch.from_numpy(best_iscale), torch.from_numpy(best_offset)).numpy()
    codes = np.where(flat, F32(0), codes)
    return np.where(flat, F32(0), scale), -offset, np.ascontiguousarray(codes.T).astype(np.int32)


def make_qx_quants(
    x: np.ndarray, nmax: int, weights: np.ndarray | None = None, codes: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    """Symmetric ``x ≈ scale·L``, L in [−nmax, nmax−1]; ggml's ``make_qx_quants`` with rmse_type 1.

    Weights default to x² (rmse_type 1). Searches 18 inverse scales ``−(nmax + 0.1·i)/max`` around
    the plain one and keeps the least-squares scale of the best. Returns scale ``[N]`` (signed) and
    the codes ``L + nmax`` of the chosen rounding ``[N, n]`` (all 0 for an all-zero group), or None with
    ``codes=False`` (Q6_K rounds again with its final scales and needs these only where a scale rounds to 0).
    Transposed ``[n, N]`` with the elementwise work in torch, as `make_qkx2_quants`. Unlike there, a trial
    here does not depend on the ones before it (every inverse scale is known from ``max``), so the sums of
    `QX_TRIALS_AT_ONCE` trials are formed together, and only the choice among them runs trial by trial.
    """
    x = x.astype(F32, copy=False)
    found = qx_scales(x, nmax, weights, GROUP_MAX_EPS)  # compiled (formats/gguf/csrc/qx_search.c): the same bits
    if found is None:
        scale, chosen, empty = _qx_search(x, nmax, weights)
    else:
        scale, chosen = found
    if not codes:
        return scale, None
    if found is not None:
        empty = np.abs(x).max(axis=1) < GROUP_MAX_EPS
    rounded = (as_torch(x) * torch.from_numpy(chosen)[:, None]).round_().clamp_(-nmax, nmax - 1).add_(nmax)
    if empty.any():
        rounded.masked_fill_(torch.from_numpy(empty)[:, None], 0)
    return scale, rounded.to(torch.int32).numpy()


def _qx_search(x: np.ndarray, nmax: int, weights: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`make_qx_quants`' search in numpy: each group's scale, the inverse scale kept, and which groups are empty."""
    groups, n = x.shape
    xt = torch.from_numpy(np.ascontiguousarray(x.T))
    top = signed_absmax(x, columns=xt.numpy())
    empty = np.abs(top) < GROUP_MAX_EPS
    top = np.where(empty, F32(1), top)

    w_wx = torch.empty((2, n, groups), dtype=torch.float32)  # [w·x, w]: times L gives w·x·L and w·L
    if weights is None:
        torch.mul(xt, xt, out=w_wx[1])
    else:
        w_wx[1] = torch.from_numpy(weights.astype(F32, copy=False).T)
    torch.mul(w_wx[1], xt, out=w_wx[0])
    steps = np.array([s for s in range(-9, 10) if s != 0], dtype=F32)
    iscales = np.empty((1 + steps.size, groups), dtype=F32)  # the plain inverse scale first, then the trials'
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(F32(-nmax), top, out=iscales[0])
        np.divide(-(F32(nmax) + F32(0.1) * steps)[:, None], top, out=iscales[1:])
    sums = np.empty((iscales.shape[0], 2, groups), dtype=F32)  # Σw·x·L, Σw·L² of each trial's rounding
    at_once = min(QX_TRIALS_AT_ONCE, iscales.shape[0])
    levels = torch.empty((at_once, n, groups), dtype=torch.float32)
    terms = np.empty((at_once, 2, n, groups), dtype=F32)  # per weight: w·x·L, w·L²
    terms_t, iscales_t = torch.from_numpy(terms), torch.from_numpy(iscales)
    for first in range(0, iscales.shape[0], at_once):
        k = min(at_once, iscales.shape[0] - first)
        level = torch.mul(xt, iscales_t[first : first + k, None, :], out=levels[:k]).round_().clamp_(-nmax, nmax - 1)
        torch.mul(w_wx, level[:, None], out=terms_t[:k])[:, 1].mul_(level)
        _running_sum(terms[:k], axis=2, out=sums[first : first + k])
    slx, sl2 = sums[0]
    chosen = iscales[0].copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(sl2 != 0, slx / sl2, F32(0))  # ggml's `suml2 ? sumlx/suml2 : 0`: negative importance too
        best = scale * slx
        for iscale, (slx, sl2) in zip(iscales[1:], sums[1:]):  # in ggml's order: the first of equals stays
            better = (sl2 > 0) & (slx * slx > best * sl2)
            trial_scale = slx / sl2
            np.copyto(scale, trial_scale, where=better)
            np.copyto(best, trial_scale * slx, where=better)
            np.copyto(chosen, iscale, where=better)
    return np.where(empty, F32(0), scale), chosen, empty


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric ``x ≈ scale·L``, L in [−nmax, nmax−1]: ggml's ``make_q3_quants`` with do_rmse.

    Starts from plain rounding at ``−nmax/max`` and makes up to 5 passes of coordinate descent on
    the x²-weighted least-squares fit, element by element. Returns scale ``[N]`` (signed) and the
    codes ``L + nmax`` ``[N, n]`` (all 0 for an all-zero group). Transposed (``[n, N]``: each element's
    row contiguous); a pass that changes nothing would change nothing again, so each pass runs only
    on the groups the previous one changed (ggml's early exit). Compiled where it can be (`native_search.q3_fit`: the
    same bits, one group at a time).
    """
    found = q3_fit(x, nmax, GROUP_MAX_EPS)
    if found is not None:
        return found
    x = x.astype(F32, copy=False)
    xt = np.ascontiguousarray(x.T)
    top = signed_absmax(x, columns=xt)
    empty = np.abs(top) < GROUP_MAX_EPS
    iscale = F32(-nmax) / np.where(empty, F32(1), top)
    levels = np.clip(np.rint(iscale * xt), -nmax, nmax - 1)
    w = xt * xt
    wx = w * xt
    sumlx = _running_sum(wx * levels)
    suml2 = _running_sum(w * levels * levels)
    moving = np.flatnonzero(~empty)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(5):
            if moving.size == 0:
                break
            xs, ws, wxs, ls = xt[:, moving], w[:, moving], wx[:, moving], levels[:, moving]
            slx_all, sl2_all = sumlx[moving], suml2[moving]
            changed = np.zeros(moving.size, dtype=bool)
            for xi, wi, wxi, li in zip(xs, ws, wxs, ls):
                slx = slx_all - wxi * li
                sl2 = sl2_all - wi * li * li
                new = np.rint(xi * sl2 / slx).astype(np.int32)  # nearest_int: non-finite -> INT_MIN -> -nmax
                new = np.minimum(np.maximum(new, -nmax, out=new), nmax - 1, out=new).astype(F32)
                slx_new = slx + wxi * new
                sl2_new = sl2 + wi * new * new
                take = ((slx > 0) & (new != li) & (sl2_new > 0)
                        & (slx_new * slx_new * sl2_all > slx_all * slx_all * sl2_new))
                np.copyto(li, new, where=take)
                slx_all = np.where(take, slx_new, slx_all)
                sl2_all = np.where(take, sl2_new, sl2_all)
                changed |= take
            levels[:, moving], sumlx[moving], suml2[moving] = ls, slx_all, sl2_all
            moving = moving[changed]
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    codes = np.where(empty[:, None], 0, levels.T.astype(np.int32) + nmax)
    return np.where(empty, F32(0), scale).astype(F32), codes


def make_qp_quants(x: np.ndarray, nmax: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unsigned ``x ≈ scale·L``, L in [0, nmax], w-weighted: ggml's ``make_qp_quants``.

    Used to quantize a super-block's sub-block scales (x ≥ 0) with the sub-blocks' total importance as
    weights: 8 trial inverse scales ``(nmax + 0.1·i)/max`` around the plain one, then up to 5 passes of
    coordinate descent on the weighted least-squares fit. Returns (scale [N], L [N, n] int32).
    A negative x (IQ2_XXS fits magnitudes of which one per 8 may be negated) rounds to a negative level, which
    ggml keeps in its ``uint8_t`` L array: where ggml reads L back it sees the level mod 256, and so do we. Compiled
    where it can be (`native_search.qp_fit`: the same bits, one group at a time).
    """
    found = qp_fit(x, nmax, w, GROUP_MAX_EPS)
    if found is not None:
        return found
    x = x.astype(F32, copy=False)
    w = w.astype(F32, copy=False)
    top = np.maximum(x.max(axis=1), F32(0))
    empty = top < GROUP_MAX_EPS
    top = np.where(empty, F32(1), top)
    xt, wt = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)

    def mse(iscale, clamp):
        levels = np.rint(iscale * xt)
        levels = np.minimum(levels, nmax) if clamp else np.mod(levels, F32(256))  # the plain try is read from L
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
    signed = np.minimum(np.rint(chosen * xt), nmax)
    sumlx = _running_sum(wt * xt * signed)
    suml2 = _running_sum(wt * signed * signed)
    levels = np.mod(signed, F32(256))  # as stored in L
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
                levels[i] = np.where(take, np.mod(new, F32(256)), li)
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
                changed |= take
            active &= changed
            if not active.any():
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    codes = np.where(empty[:, None], 0, levels.T.astype(np.int32))
    return np.where(empty, F32(0), scale).astype(F32), codes
