"""GGUF block codecs against gguf-py (the reference decoder/encoder) and llama.cpp's own quantizer."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from compress.formats.gguf.codecs import CODECS, decode_tensor, encode_tensor, needs_importance  # noqa: E402
from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType  # noqa: E402
from references import one_line_error  # noqa: E402

ALL = list(CODECS)
K_QUANTS = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
I_QUANTS = [GGMLType.IQ4_NL, GGMLType.IQ4_XS]
GGUF_PY_ENCODES = [GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1]


def weights(rows: int = 24, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Gaussian rows with the awkward cases: an all-zero row, a constant row, a heavy outlier,
    all-positive and all-negative rows, and exact half-step ties."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    w[1] = 0
    w[2] = 0.01
    w[3, 7] = 1.5
    w[4] = np.abs(w[4])
    w[5] = -np.abs(w[5])
    w[6] = np.round(rng.standard_normal(cols) * 8) / 16  # many values on exact grid points and ties
    w[7, :32] = 0  # a zero block inside a non-zero row
    w[8] *= 1e-6
    return w


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_size_table_matches_gguf_py():
    for kind, (block, size) in BLOCK_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(kind))] == (block, size), kind


@pytest.mark.parametrize("kind", ALL, ids=lambda k: k.name)
def test_decode_is_bit_exact_with_gguf_py_on_our_encoding(kind):
    w = weights()
    data = encode_tensor(w, kind, np.random.default_rng(2).gamma(0.5, 2.0, w.shape[1]) if needs_importance(kind) else None)
    ours = decode_tensor(data, kind, w.shape[1])
    ref = dequantize(data.copy(), gguf.GGMLQuantizationType(int(kind))).reshape(ours.shape)
    assert same_bits(ours, ref)


@pytest.mark.parametrize("kind", ALL, ids=lambda k: k.name)
def test_decode_is_bit_exact_with_gguf_py_on_random_blocks(kind):
    """Random bytes reach every code and scale value; float16 fields are forced finite."""
    block, size = BLOCK_SIZES[kind]
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size=(64, size), dtype=np.uint8)
    halves = {GGMLType.Q2_K: [80, 82], GGMLType.Q3_K: [108], GGMLType.Q6_K: [208]}.get(kind)
    if halves is None:
        halves = [0, 2] if kind in (GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K) else [0]
    for at in halves:
        data[:, at : at + 2] = (rng.standard_normal((64, 1)) * 0.01).astype("<f2").view(np.uint8)
    if kind == GGMLType.BF16:
        data[:, 1] = (data[:, 1] & 0x83) | 0x3C  # a finite exponent: NaN payloads need not be preserved
    if kind == GGMLType.F16:
        data = rng.standard_normal((64, 1)).astype("<f2").view(np.uint8)
    ours = decode_tensor(data, kind, block)
    ref = dequantize(data.copy(), gguf.GGMLQuantizationType(int(kind))).reshape(ours.shape)
    assert same_bits(ours, ref)


@pytest.mark.parametrize("kind", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.IQ4_NL], ids=lambda k: k.name)
def test_a_tensor_decoded_in_parts_on_two_threads_is_bit_exact_with_gguf_py(kind, monkeypatch):
    from compress.formats.gguf import codecs

    monkeypatch.setattr(codecs, "encoding_cpus", lambda: 2)
    block, size = BLOCK_SIZES[kind]
    w = weights(rows=600, cols=2048, seed=4)  # 1.2 M weights: several parts of the decode
    workers, parts = codecs.plan_parts(w.size // block, block, codecs.DIRECT_CHUNK_ELEMENTS, 2)
    assert workers == 2 and len(parts) > 2
    data = encode_tensor(w, kind, np.ones(w.shape[1], dtype=np.float32) if needs_importance(kind) else None)
    ours = decode_tensor(data, kind, w.shape[1])
    ref = dequantize(data.copy(), gguf.GGMLQuantizationType(int(kind))).reshape(ours.shape)
    assert same_bits(ours, ref)


def test_a_decode_into_rows_of_a_larger_array_is_gguf_pys_and_a_wrong_out_is_refused():
    kind = GGMLType.Q4_K
    w = weights(rows=10, cols=512, seed=5)
    data = encode_tensor(w, kind)
    whole = np.full((14, 512), np.nan, dtype=np.float32)
    assert decode_tensor(data, kind, 512, whole[2:12]) is not None
    ref = dequantize(data.copy(), gguf.GGMLQuantizationType(int(kind))).reshape(10, 512)
    assert same_bits(whole[2:12], ref) and np.isnan(whole[:2]).all() and np.isnan(whole[12:]).all()
    for wrong in (np.empty((10, 512), np.float64), np.empty((10, 1024), np.float32)[:, :512], np.empty((4, 512), np.float32)):
        with pytest.raises(ValueError, match="C-contiguous float32"):
            decode_tensor(data, kind, 512, wrong)


@pytest.mark.parametrize("kind", GGUF_PY_ENCODES, ids=lambda k: k.name)
def test_encode_is_bit_exact_with_gguf_py(kind):
    w = weights()
    ref = quantize(w, gguf.GGMLQuantizationType(int(kind))).view(np.uint8).reshape(w.shape[0], -1)
    assert np.array_equal(encode_tensor(w, kind), ref)


@pytest.mark.parametrize("kind", K_QUANTS + I_QUANTS, ids=lambda k: k.name)
def test_k_quant_unpack_inverts_pack(kind):
    """The grid and codes read back from our bytes re-pack to the same bytes."""
    codec = CODECS[kind]
    data = encode_tensor(weights(), kind).reshape(-1, BLOCK_SIZES[kind][1])
    grid, codes = codec.unpack(data)
    assert np.array_equal(codec.pack(grid, codes), data)


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda k: k.name)
def test_k_quant_codes_are_nearest_on_their_grid(kind):
    """Property of the reference quantizer: given the stored grid, every code is the nearest level
    (within the code range), so re-rounding the original weights on the decoded grid changes nothing."""
    codec = CODECS[kind]
    w = weights(seed=3)
    blocks = w.reshape(-1, 256)
    grid, codes = codec.unpack(encode_tensor(w, kind).reshape(blocks.shape[0], -1))
    again = codec.round_codes(blocks, grid)
    step = grid.scale()
    live = np.repeat(step != 0, 256 // step.shape[1], axis=1)
    assert np.array_equal(again[live], codes[live])


@pytest.mark.parametrize(
    "kind, bound",
    [(GGMLType.Q2_K, 0.30), (GGMLType.Q3_K, 0.152), (GGMLType.Q4_K, 0.072), (GGMLType.Q5_K, 0.0365), (GGMLType.Q6_K, 0.018)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_k_quant_error_on_gaussian_weights(kind, bound):
    """Sanity bound on the relative RMS error for Gaussian weights (llama.cpp's own quantizer gives
    0.296/0.150/0.071/0.036/0.018 on this very matrix); the exact comparison with ggml's encoder is
    in test_ggml_reference.py."""
    w = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32)
    dec = decode_tensor(encode_tensor(w, kind), kind, 1024)
    rel = float(np.sqrt(((dec - w) ** 2).mean() / (w**2).mean()))
    assert rel < bound


def test_rows_that_do_not_fit_the_block_are_an_error():
    msg = one_line_error(encode_tensor, np.zeros((2, 96), np.float32), GGMLType.Q4_K)
    assert "Q4_K" in msg and "96" in msg


def test_iq4_codebook_is_gguf_py_table():
    from compress.formats.gguf import iq4_nl

    assert iq4_nl.KVALUES.tolist() == list(gguf.quants.IQ4_NL.kvalues)
    assert iq4_nl.LEVELS.dtype == np.float32 and (np.diff(iq4_nl.LEVELS) > 0).all()


def test_iq4_nearest_level_is_brute_force_nearest_with_ties_up():
    """ggml's ``best_index_int8``: the nearest entry, clamped outside the table, the upper one on a tie."""
    from compress.formats.gguf.iq4_nl import LEVELS, nearest_level

    rng = np.random.default_rng(0)
    midpoints = (LEVELS[:-1] + LEVELS[1:]) / 2
    v = np.concatenate([rng.uniform(-160, 160, 4000), midpoints, LEVELS, [-1000.0, 1000.0, 0.0, -0.0]]).astype(np.float32)
    dist = np.abs(v[:, None] - LEVELS[None, :])
    upper_on_ties = len(LEVELS) - 1 - np.argmin(dist[:, ::-1], axis=1)
    np.testing.assert_array_equal(nearest_level(v), upper_on_ties)


@pytest.mark.parametrize("kind, bound", [(GGMLType.IQ4_NL, 0.0761), (GGMLType.IQ4_XS, 0.0766)], ids=lambda v: getattr(v, "name", str(v)))
def test_iq4_error_on_gaussian_weights(kind, bound):
    """llama.cpp's own quantizer gives 0.0760 (IQ4_NL) and 0.0766 (IQ4_XS) on this matrix (Q4_0: 0.0858):
    the non-uniform codebook beats the uniform grid at the same 4.5 bits."""
    w = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32)
    rel = {k: float(np.sqrt(((decode_tensor(encode_tensor(w, k), k, 1024) - w) ** 2).mean() / (w**2).mean()))
           for k in (kind, GGMLType.Q4_0)}
    assert rel[kind] < bound and rel[kind] < 0.9 * rel[GGMLType.Q4_0]


def test_iq3_s_grid_is_gguf_py_table_and_neighbours_are_nearest():
    """The 512 points are gguf-py's IQ3_S grid; an off-grid level 4-tuple's neighbour list holds exactly
    the points at its 3 smallest squared distances (brute force), nearest first."""
    from compress.formats.gguf import iq3_s

    gguf.quants.IQ3_S.init_grid()
    np.testing.assert_array_equal(iq3_s.codebook(), gguf.quants.IQ3_S.grid.reshape(512, 4))
    t = iq3_s.tables()
    points = iq3_s.codebook().astype(np.int64)
    for code in np.flatnonzero(t.index < 0)[::97]:
        value = 2 * ((code >> (3 * np.arange(4))) & 7) + 1
        d2 = ((points - value) ** 2).sum(axis=1)
        nearest = np.flatnonzero(d2 <= np.unique(d2)[2])
        found = t.neighbours[t.row[code], : t.count[t.row[code]]]
        assert sorted(found) == sorted(nearest) and (np.diff(d2[found]) >= 0).all()
    assert sorted(t.index[t.index >= 0]) == list(range(512))


def test_iq2_xs_neighbours_are_nearest_and_it_needs_an_importance_matrix():
    """IQ2_XS's 512 points (gguf-py's grid, levels 8/25/43 -> 0/1/2): an off-grid 8-tuple of levels 0..2 lists
    exactly the points at its 2 smallest squared distances (brute force); without importance, a one-line error."""
    from compress.formats.gguf import iq2_xs

    t = iq2_xs.grid_tables()
    points = 2 * t.grid.astype(np.int64) + 1
    codes = [c for c in np.flatnonzero(t.index < 0) if ((c >> (2 * np.arange(8))) & 3).max() <= 2]
    assert len(codes) == 3**8 - 512
    for code in codes[::131]:
        value = 2 * ((code >> (2 * np.arange(8))) & 3) + 1
        d2 = ((points - value) ** 2).sum(axis=1)
        found = t.neighbours[t.row[code], : t.count[t.row[code]]]
        assert sorted(found) == list(np.flatnonzero(d2 <= np.unique(d2)[1])) and (np.diff(d2[found]) >= 0).all()
    assert "IQ2_XS needs an importance matrix" in one_line_error(encode_tensor, weights(), GGMLType.IQ2_XS)


def test_iq3_s_unpack_inverts_pack():
    from compress.formats.gguf import iq3_s

    w = weights()
    w[7, :32] = 1e-3  # no all-zero block (ggml's encoder skips those; unpack cannot know)
    w[1] = 1e-3
    data = encode_tensor(w, GGMLType.IQ3_S).reshape(-1, 110)
    assert np.array_equal(iq3_s.pack(*iq3_s.unpack(data)), data)


@pytest.mark.parametrize("kind", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.IQ4_NL], ids=lambda k: k.name)
def test_float16_weights_encode_as_their_float32_values(kind, monkeypatch):
    """An F16 file's weights are made float32 a chunk at a time (several chunks here): the bytes of the float32
    values, which test_ggml_reference.py checks against ggml's, with and without an importance vector."""
    import compress.formats.gguf.codecs as codecs

    monkeypatch.setattr(codecs, "CHUNK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(codecs, "DIRECT_CHUNK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(codecs, "POOL_CHUNK_ELEMENTS", 1 << 13)
    monkeypatch.setattr(codecs, "MIN_PART_ELEMENTS", 1 << 13)
    w = (np.random.default_rng(3).standard_normal((64, 512)) * 0.02).astype(np.float16)
    importance = np.random.default_rng(4).gamma(0.5, 2.0, 512).astype(np.float32)
    assert np.array_equal(encode_tensor(w, kind), encode_tensor(w.astype(np.float32), kind))
    assert np.array_equal(encode_tensor(w, kind, importance), encode_tensor(w.astype(np.float32), kind, importance))


@pytest.mark.parametrize("rows, cols, chunk, cpus, workers, first_part", [
    (2048, 256, 1 << 17, 2, 2, 1024),  # a GGUF-GPTQ fit's super-block column (2^19 weights): one half per CPU
    (1000, 256, 1 << 17, 2, 1, 512),  # under 2 x 2^18 weights: one thread, 2^17 at a time
    (8192, 1024, 1 << 17, 2, 2, 2048),  # large: pool tasks of 2^19 weights
    (8192, 1024, 1 << 17, 1, 1, 512),  # one CPU
    (2048, 256, 1 << 19, 2, 1, 2048),  # a direct rounding's 2^19: one thread, one task
    (3000, 1024, 1 << 17, 4, 4, 2048),  # 4 CPUs, large
    (700, 1024, 1 << 17, 4, 2, 1400),  # 4 CPUs, 2.7 x 2^18 weights: two parts, each at least 2^18
])
def test_in_chunks_parts_cover_the_blocks_once(rows, cols, chunk, cpus, workers, first_part):
    """``first_part``: blocks of 256 weights in the first part."""
    from compress.formats.gguf.codecs import plan_parts

    n, block = rows * cols // 256, 256
    got_workers, parts = plan_parts(n, block, chunk, cpus)
    assert got_workers == workers
    covered = np.concatenate([np.arange(n)[p] for p in parts])
    assert np.array_equal(covered, np.arange(n))  # every block once, in order
    assert parts[0].stop - parts[0].start == first_part
    if workers > 1:
        assert len(parts) >= workers and all((p.stop - p.start) * block >= (1 << 18) for p in parts)


@pytest.mark.parametrize("default", ["float16", "float64"])
def test_bytes_do_not_depend_on_torchs_default_dtype(default):
    """torch's default dtype is process-wide, and transformers sets it while it builds a model: the export's config
    check does so on a thread beside the encoding. Every encoder must name its dtypes (an IQ3_S distance buffer that
    did not name its dtype came out float16 there, and the bytes differed from llama.cpp's now and then)."""
    import torch

    w = weights(rows=12)
    importance = np.random.default_rng(4).gamma(0.5, 2.0, 512).astype(np.float32)
    kinds = [k for k in ALL if BLOCK_SIZES[k][0] > 1]  # the block types (F16, BF16 and F32 are conversions)

    def encode(kind):
        return encode_tensor(w, kind, importance if needs_importance(kind) else None)

    expected = {k: encode(k) for k in kinds}
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, default))
    try:
        changed = [k.name for k in kinds if not np.array_equal(encode(k), expected[k])]
    finally:
        torch.set_default_dtype(before)
    assert not changed
