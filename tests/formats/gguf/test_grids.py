"""The affine view of the GGUF block types used by GPTQ-in-GGUF (`compress.formats.gguf.grids`)."""

from __future__ import annotations

import numpy as np
import pytest

from compress.formats.gguf import grids
from compress.formats.gguf.codecs import CODECS
from compress.formats.gguf.sizes import GGMLType

QUANTIZED = [k for k in CODECS if grids.is_block_quantized(k) and not grids.is_lattice(k)]
LATTICE = [k for k in CODECS if grids.is_lattice(k)]
K_QUANTS = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


def blocks_of(kind: GGMLType, n: int = 48, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, grids.block_size(kind))).astype(np.float32)
    x[0] = 0.0  # an all-zero block: every step is 0
    x[1, ::3] *= 20  # outliers
    return x


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.name)
def test_any_codes_decode_to_step_times_code_minus_offset(kind):
    """The decoder (the format's reference) of any code on a fitted grid is ``step·level(q) − offset``."""
    x = blocks_of(kind)
    grid = grids.fit(kind, x)
    rng = np.random.default_rng(1)
    codes = rng.integers(grid.lo, grid.hi + 1, size=x.shape)
    decoded = CODECS[kind].decode(grids.pack(grid, codes))
    np.testing.assert_allclose(decoded, grid.values(codes), rtol=1e-6, atol=1e-7)
    if grid.levels is not None:  # a codebook: the levels are the codec's table, the decode exactly step·level
        np.testing.assert_array_equal(decoded, grid.step * grid.levels[codes - grid.lo])
    assert (grid.step[0] == 0).all()


@pytest.mark.parametrize("kind", [k for k in QUANTIZED if hasattr(CODECS[k], "affine")], ids=lambda k: k.name)
def test_a_legacy_types_step_and_offset_are_the_decodes_of_codes_zero_and_one(kind):
    """The grid of a type with one scale (and minimum) per block, taken from them (`affine`), has the bits of the
    decoder's (the format's reference) output for all-zero and all-one codes: step their difference, offset minus
    the first (negative scales and minimums included: the sign of every zero counts)."""
    x = blocks_of(kind) * np.where(np.arange(48) % 2, 1, -1).astype(np.float32)[:, None]
    x[5] += 3.0  # a block of one sign: its minimum is not zero
    grid = grids.fit(kind, x)
    zeros = np.zeros(x.shape, dtype=np.int64)
    at_zero = CODECS[kind].decode(grids.pack(grid, zeros))
    at_one = CODECS[kind].decode(grids.pack(grid, zeros + 1))
    assert np.array_equal((at_one - at_zero).view(np.uint32), grid.step.view(np.uint32))
    assert np.array_equal((-at_zero).view(np.uint32), grid.offset.view(np.uint32))


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.name)
def test_fit_and_nearest_codes_reproduce_ggml_rounding(kind):
    """Nearest codes on the encoder's own grid give ggml's bytes (k-quants round to nearest on the
    final grid; the legacy types round with the unrounded scale, so a few codes may differ there)."""
    x = blocks_of(kind)
    grid = grids.fit(kind, x)
    ours = grids.pack(grid, grid.codes(x))
    ggml = CODECS[kind].encode(x)
    if kind in K_QUANTS:
        np.testing.assert_array_equal(ours, ggml)
    else:
        assert (ours == ggml).mean() > 0.95
        decode = CODECS[kind].decode
        assert np.square(decode(ours) - x).sum() <= np.square(decode(ggml) - x).sum() * (1 + 1e-6)


@pytest.mark.parametrize("kind", [GGMLType.Q4_K, GGMLType.Q4_0, GGMLType.Q6_K], ids=lambda k: k.name)
def test_importance_fit_is_the_weighted_encoders_grid(kind):
    x = blocks_of(kind)
    qw = np.random.default_rng(2).random(x.shape).astype(np.float32)
    sigma2 = np.mean(x * x, axis=1, keepdims=True)
    grid = grids.fit(kind, x, qw, sigma2)
    weighted = CODECS[kind].encode_weighted(x, qw, sigma2)
    _, codes = CODECS[kind].unpack(weighted)
    np.testing.assert_array_equal(grids.pack(grid, codes), weighted)  # same grid: same bytes with its codes


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.name)
def test_stored_grid_writes_the_bytes_again_with_their_codes(kind):
    """Bytes of a fitted grid with random codes: the grid `stored` reads from them and the codec's own unpacked codes
    pack to the same bytes, and the codec decodes them to that grid's ``step·level(q) − offset``."""
    x = blocks_of(kind, seed=3)
    fitted = grids.fit(kind, x)
    data = grids.pack(fitted, np.random.default_rng(2).integers(fitted.lo, fitted.hi + 1, size=x.shape))
    grid = grids.stored(kind, data)
    codes = CODECS[kind].unpack(data)[1].astype(np.int64)
    assert np.array_equal(grids.pack(grid, codes), data)
    np.testing.assert_allclose(CODECS[kind].decode(data), grid.values(codes), rtol=1e-6, atol=1e-7)


def test_codes_out_of_range_are_refused():
    x = blocks_of(GGMLType.Q4_K)
    grid = grids.fit(GGMLType.Q4_K, x)
    with pytest.raises(ValueError, match="range"):
        grids.pack(grid, np.full(x.shape, 16))
    assert not grids.is_block_quantized(GGMLType.F16)


@pytest.mark.parametrize("kind", LATTICE, ids=lambda k: k.name)
def test_any_points_and_signs_decode_to_step_times_point(kind):
    """A lattice type's decoder (the format's reference) of any points and signs on a fitted grid is
    ``step·point·(±1)``, bit for bit."""
    x = blocks_of(kind)
    grid = grids.fit(kind, x)
    rng = np.random.default_rng(1)
    points = rng.integers(0, len(grid.points), size=(x.shape[0], x.shape[1] // grid.group))
    negative = rng.random(x.shape) < 0.5
    if grid.parity:  # the 8th sign of each 8 is the parity of the 7 (IQ3_XXS, IQ2_XXS, IQ2_XS)
        groups = negative.reshape(-1, grid.parity)
        groups[:, -1] = groups[:, :-1].sum(axis=1) % 2 == 1
    decoded = CODECS[kind].decode(grids.pack_lattice(grid, points, negative))
    values = grid.points[points].reshape(x.shape)
    np.testing.assert_array_equal(decoded, (grid.step * values) * np.where(negative, -1, 1).astype(np.float32))
    assert (grid.step[0] == 0).all() and (grid.step[1:] > 0).all()
    with pytest.raises(ValueError, match="codebook"):
        grids.pack_lattice(grid, points + len(grid.points), negative)


@pytest.mark.parametrize("kind", [k for k in LATTICE if hasattr(CODECS[k], "unpack")], ids=lambda k: k.name)
def test_lattice_fit_is_the_encoders_grid(kind):
    """The encoder's own points and signs, packed on `fit`'s grid, are the encoder's bytes (no block is
    all zero here, so ggml's pointer lag over empty blocks does not arise)."""
    x = blocks_of(kind)[1:]
    qw = np.random.default_rng(2).random(x.shape).astype(np.float32)
    for importance in (None, qw):
        data = CODECS[kind].encode(x) if importance is None else CODECS[kind].encode_weighted(x, qw)
        _, points, negative = CODECS[kind].unpack(data)
        np.testing.assert_array_equal(grids.pack_lattice(grids.fit(kind, x, importance), points, negative), data)


@pytest.mark.parametrize("kind", LATTICE, ids=lambda k: k.name)
def test_lattice_fit_in_row_parts_on_threads_is_the_fit_of_the_whole(kind, monkeypatch):
    """`fit` hands parts of the rows to the encoders' threads (here 16 rows a part on 2 threads) and joins their
    grids: each row's grid is what the codec fits for all the rows at once."""
    import compress.formats.gguf.codecs as codecs

    monkeypatch.setattr(codecs, "CHUNK_ELEMENTS", 16 * 256)
    monkeypatch.setattr(codecs, "POOL_CHUNK_ELEMENTS", 16 * 256)
    monkeypatch.setattr(codecs, "MIN_PART_ELEMENTS", 16 * 256)
    monkeypatch.setattr(codecs, "encoding_cpus", lambda: 2)
    x = blocks_of(kind, n=72)
    qw = np.random.default_rng(2).random(x.shape).astype(np.float32)
    whole = CODECS[kind].fit_grid(x, qw)
    joined = grids.fit(kind, x, qw).grid
    assert type(joined) is type(whole)
    for name, value in vars(whole).items():
        np.testing.assert_array_equal(getattr(joined, name), value)
