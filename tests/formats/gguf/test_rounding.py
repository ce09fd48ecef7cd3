"""`_common.round_half_away_` against C's ``roundf`` written out in float64 (``sign(v)·floor(|v| + 0.5)``, exact
there for every float32 ``v``): ties both ways, the neighbours of every tie, 0.49999997, signed zeros, ordinary values.
`_common.float32_of` against float16's definition, bit pattern by bit pattern."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from compress.formats.gguf._common import float32_of, round_half_away_


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


def float16_value(bits: np.ndarray) -> np.ndarray:
    """IEEE binary16 decoded by its definition (float64): sign, 5 exponent bits (bias 15), 10 fraction bits."""
    sign = np.where(bits >> 15, -1.0, 1.0)
    exponent, fraction = (bits >> 10) & 0x1F, (bits & 0x3FF).astype(np.float64)
    normal = sign * np.ldexp(1.0 + fraction / 1024, exponent.astype(np.int64) - 15)
    value = np.where(exponent == 0, sign * np.ldexp(fraction / 1024, -14), normal)  # subnormals and ±0
    return np.where(exponent == 0x1F, np.where(fraction == 0, sign * np.inf, np.nan), value)


def test_float32_of_is_float16s_value_for_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32)
    half = bits.astype(np.uint16).view(np.float16).reshape(256, 256)
    half.flags.writeable = False  # as a memory-mapped file's tensor is
    expected = float16_value(bits).reshape(256, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning: a read-only array is copied first
        results = (float32_of(half), float32_of(half[:, ::-2]), float32_of(half, out=np.empty((256, 256), np.float32)))
    for got in results:
        want = expected[:, ::-2] if got.shape == (256, 128) else expected
        assert got.dtype == np.float32
        assert np.array_equal(got, want.astype(np.float32), equal_nan=True)
        number = ~np.isnan(want)
        assert np.array_equal(np.signbit(got[number]), np.signbit(want[number]))  # -0 stays -0
    single = np.ones((4, 4), np.float32)
    assert float32_of(single) is single
