"""`_common.round_half_away_` against C's ``roundf`` written out in float64 (``sign(v)·floor(|v| + 0.5)``, exact
there for every float32 ``v``): ties both ways, the neighbours of every tie, 0.49999997, signed zeros, ordinary values."""

from __future__ import annotations

import numpy as np
import torch

from compress.formats.gguf._common import round_half_away_


def c_roundf(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def test_is_c_roundf():
    ties = np.arange(-130, 130, 0.5, dtype=np.float32)
    v = np.concatenate([
        np.random.default_rng(0).standard_normal(50_000).astype(np.float32) * 60,
        ties, np.nextafter(ties, np.float32(1e9)), np.nextafter(ties, np.float32(-1e9)),
        np.array([0.49999997, -0.49999997, 0.0, -0.0, 127.5, -128.5], dtype=np.float32),
    ])
    got = round_half_away_(torch.from_numpy(v.copy())).numpy()
    assert np.array_equal(got, c_roundf(v))
    assert got[np.flatnonzero(v == 2.5)[0]] == 3 and got[np.flatnonzero(v == -2.5)[0]] == -3  # torch alone gives ±2
