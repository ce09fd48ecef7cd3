"""compress.formats.gguf.native_search: the compiled make_qx_quants, make_qkx2_quants, make_qp_quants and make_q3_quants
searches keep the numpy
searches' scales, mins, choices and codes bit for bit (the numpy one is checked against ggml's bytes in this folder's other tests, which run on the
compiled one wherever a C compiler is present), on groups built to hit its edge cases, and so the encoders that use
it write the same bytes either way."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from compress.formats.gguf import _common, q2_k, q3_k, q4_0, q4_k, q5_k, q6_k, solvers
from compress.formats.gguf.native_search import MAX_N, q3_fit, qkx2_fit, qp_fit, qx_scales

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler on this machine")


def edge_groups(n: int, seed: int) -> np.ndarray:
    """Random groups, and ones that are all zero, under ggml's GROUP_MAX_EPS, tied in magnitude (+a and −a, either
    first), of one value, huge and tiny (float32's range), with +0 and −0 as their smallest values, and a short last
    tile (37 groups)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((37, n)) * 0.02).astype(np.float32)
    x[0] = 0
    x[1] = 1e-16
    x[2, :2] = [0.5, -0.5]
    x[3, :2] = [-0.5, 0.5]
    x[4] = 0
    x[4, n // 2] = -3.0
    x[5] *= 1e30
    x[6] *= 1e-30
    x[7] = np.round(x[7] * 1e3) / 1e3  # values on a decimal grid: more near-ties between candidate scales
    x[11] = np.abs(x[11])
    x[11, :2] = [0.0, -0.0]  # the smallest value is a zero of either sign: which one is kept shows in the min's sign
    x[12] = np.abs(x[12])
    x[12, :2] = [-0.0, 0.0]
    return x


@pytest.mark.parametrize("n,nmax", [(16, 32), (16, 4), (32, 8), (32, 16)])
@pytest.mark.parametrize("weighted", [False, True])
def test_compiled_search_equals_the_numpy_search_bit_for_bit(n, nmax, weighted):
    x = edge_groups(n, seed=n + nmax)
    weights = None
    if weighted:  # importance weights, some negative (ggml's sums take them as they come) and some zero
        weights = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
        weights[10] = 0
    scale, chosen = qx_scales(x, nmax, weights, _common.GROUP_MAX_EPS)
    with np.errstate(over="ignore"):  # the 1e30 group's squares overflow in numpy as in C (to inf, compared alike)
        ref_scale, ref_chosen, empty = solvers._qx_search(x, nmax, weights)
    np.testing.assert_array_equal(scale.view(np.uint32), ref_scale.view(np.uint32))
    live = ~empty  # an empty group's kept inverse scale is never read (its codes are written as zeros)
    np.testing.assert_array_equal(chosen[live].view(np.uint32), ref_chosen[live].view(np.uint32))


@pytest.mark.parametrize("n,nmax,rmin,rdelta,nstep,use_mad", [
    (32, 15, -1.0, 0.1, 20, False), (32, 31, -0.5, 0.1, 15, False), (16, 3, -0.5, 0.1, 15, True),
    (32, 15, -0.9, 0.05, 36, False),
])
def test_compiled_asymmetric_search_equals_the_numpy_search_bit_for_bit(n, nmax, rmin, rdelta, nstep, use_mad, monkeypatch):
    x = edge_groups(n, seed=nmax)
    x[8] = np.abs(x[8])  # all positive: the min clamps to 0
    x[9] = 0.25  # flat
    w = np.abs(np.random.default_rng(2).standard_normal(x.shape)).astype(np.float32)
    w[10] = 0  # no weight at all: the least-squares fits divide by zero, as in numpy
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        got = qkx2_fit(x, w, nmax, rmin, rdelta, nstep, use_mad)
        monkeypatch.setenv("COMPRESS_NATIVE", "0")
        want = solvers.make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("n,nmax", [(8, 63), (16, 15), (8, 7), (32, 3)])
def test_compiled_super_block_fit_equals_the_numpy_fit_bit_for_bit(n, nmax, monkeypatch):
    """make_qp_quants (a super-block's sub-block scales): its trials and its coordinate descent, on groups with
    negative values (IQ2_XXS's: their levels taken mod 256), all zero, below GROUP_MAX_EPS, weightless, and ties."""
    x = np.abs(edge_groups(n, seed=nmax))
    x[13] = -x[13]
    x[14, :3] = -0.002
    w = np.abs(np.random.default_rng(4).standard_normal(x.shape)).astype(np.float32)
    w[10] = 0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        got = qp_fit(x, nmax, w, _common.GROUP_MAX_EPS)
        monkeypatch.setenv("COMPRESS_NATIVE", "0")
        want = solvers.make_qp_quants(x, nmax, w)
    np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("n,nmax", [(16, 4), (32, 4), (16, 8)])
def test_compiled_q3_fit_equals_the_numpy_fit_bit_for_bit(n, nmax, monkeypatch):
    """make_q3_quants (Q3_K's sub-blocks): its plain rounding and coordinate descent on the edge groups (the 1e30
    group's squares overflow to inf, in numpy as in C)."""
    x = edge_groups(n, seed=nmax + 20)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        got = q3_fit(x, nmax, _common.GROUP_MAX_EPS)
        monkeypatch.setenv("COMPRESS_NATIVE", "0")
        want = solvers.make_q3_quants(x, nmax)
    np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
    np.testing.assert_array_equal(got[1], want[1])


def test_groups_wider_than_its_buffers_use_the_numpy_search():
    wide = np.ones((3, MAX_N + 1), dtype=np.float32)
    assert qx_scales(wide, 8, None, _common.GROUP_MAX_EPS) is None
    assert qkx2_fit(wide, wide, 15, -1.0, 0.1, 20, False) is None
    assert qp_fit(wide, 15, wide, _common.GROUP_MAX_EPS) is None
    assert q3_fit(wide, 4, _common.GROUP_MAX_EPS) is None


@pytest.mark.parametrize("encode", ["q6_k", "q6_k weighted", "q3_k", "q4_0 weighted", "q4_k", "q4_k weighted", "q5_k",
                                    "q2_k", "q2_k weighted"])
def test_encoders_write_the_same_bytes_compiled_or_not(encode, monkeypatch):
    rng = np.random.default_rng(3)
    blocks = (rng.standard_normal((64, 256)) * 0.02).astype(np.float32)
    blocks[5] = 0
    qw = rng.random(blocks.shape).astype(np.float32)
    run = {
        "q6_k": lambda: q6_k.encode(blocks),
        "q6_k weighted": lambda: q6_k.encode_weighted(blocks, qw),
        "q3_k": lambda: q3_k.encode(blocks),
        "q4_k": lambda: q4_k.encode(blocks),
        "q4_k weighted": lambda: q4_k.encode_weighted(blocks, qw),
        "q5_k": lambda: q5_k.encode(blocks),
        "q2_k": lambda: q2_k.encode(blocks),
        "q2_k weighted": lambda: q2_k.encode_weighted(blocks, qw),
        "q4_0 weighted": lambda: q4_0.encode_weighted(blocks.reshape(-1, 32), qw.reshape(-1, 32),
                                                      np.square(blocks.reshape(-1, 32)).mean(axis=1, keepdims=True)),
    }[encode]
    compiled = run()
    monkeypatch.setenv("COMPRESS_NATIVE", "0")
    np.testing.assert_array_equal(compiled, run())
