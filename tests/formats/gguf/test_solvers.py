"""`solvers.make_qx_quants` against ggml's ``make_qx_quants`` (rmse_type 1) transcribed line by line, one group at a
time in float32 scalars, with no vectorisation: scales and codes must be the very same, on groups built to make its
trial-by-trial choice matter (identical roundings from neighbouring trials, zero weights under which different
roundings tie exactly, all-zero groups, ±ties of the largest magnitude, tiny and huge values)."""

from __future__ import annotations

import numpy as np
import pytest

from compress.formats.gguf.solvers import make_qx_quants

F = np.float32


def nearest_int(v: np.float32) -> int:
    return int(np.rint(v))  # ggml's magic-number rounding: half to even, in float32


def textbook(x: np.ndarray, nmax: int, qw: np.ndarray | None) -> tuple[np.float32, list[int]]:
    """ggml-quants.c ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` for one group."""
    amax, top = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, top = abs(v), v
    if amax < F(1e-15):
        return F(0), [0] * len(x)

    def trial(iscale):
        sumlx = suml2 = F(0)
        levels = []
        for i, v in enumerate(x):
            level = max(-nmax, min(nmax - 1, nearest_int(F(iscale * v))))
            levels.append(level + nmax)
            w = qw[i] if qw is not None else F(v * v)
            sumlx = F(sumlx + F(F(w * v) * F(level)))
            suml2 = F(suml2 + F(F(w * F(level)) * F(level)))
        return sumlx, suml2, levels

    sumlx, suml2, codes = trial(F(F(-nmax) / top))
    scale = F(sumlx / suml2) if suml2 else F(0)
    best = F(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2, levels = trial(F(F(-(F(nmax) + F(F(0.1) * F(step)))) / top))
        if suml2 > 0 and F(sumlx * sumlx) > F(best * suml2):
            codes, scale = levels, F(sumlx / suml2)
            best = F(scale * sumlx)
    return scale, codes


def hard_groups(n: int, nmax: int, count: int, rng) -> tuple[np.ndarray, np.ndarray]:
    x = (rng.standard_normal((count, n)) * 0.02).astype(F)
    weights = rng.gamma(0.5, 2.0, (count, n)).astype(F)
    k = count // 8
    x[:k] = np.round(x[:k] * 400) / 400  # few distinct values: neighbouring trials often round alike
    weights[k : 2 * k, ::3] = 0  # what these weights multiply cannot tell roundings apart
    x[2 * k] = 0
    x[2 * k + 1, ::2], x[2 * k + 1, 1::2] = 0.03, -0.03  # ±ties of the largest magnitude
    x[2 * k + 2] *= F(1e-20)  # below GROUP_MAX_EPS: all zero
    x[2 * k + 3] *= F(1e-12)
    x[2 * k + 4] *= F(1e4)
    x[2 * k + 5, 1:] = 0  # one weight alone
    weights[2 * k + 6] = 0  # nothing weighs anything: every trial's Σw·L² is 0
    # the largest weighs nothing and the next rounds to 0 at the plain scale, not at the larger trial ones: the plain
    # rounding's Σw·L² is 0, and ggml's best starts from 0
    x[2 * k + 7], weights[2 * k + 7] = 0, 0
    x[2 * k + 7, :2], weights[2 * k + 7, 1] = [0.02, 0.01 / (nmax + 0.45)], 1
    weights[2 * k + 8 : 2 * k + 10] *= -1  # a hostile imatrix: negative weights, Σw·L² below 0 (ggml skips those)
    weights[2 * k + 9, ::2] *= -1
    return x, weights


@pytest.mark.parametrize("n, nmax", [(16, 32), (32, 8), (16, 4)], ids=["q6_k", "q4_0-imatrix", "q3_k-imatrix"])
@pytest.mark.parametrize("weighted", [False, True], ids=["x2", "importance"])
def test_make_qx_quants_is_ggmls_group_by_group(n, nmax, weighted):
    x, weights = hard_groups(n, nmax, 320, np.random.default_rng(n + nmax))
    qw = weights if weighted else None
    scales, codes = make_qx_quants(x, nmax, qw)
    for g in range(x.shape[0]):
        scale, levels = textbook(x[g], nmax, None if qw is None else qw[g])
        assert scales[g].tobytes() == scale.tobytes() and codes[g].tolist() == levels, g
