"""The bit-packing codec: golden words from the published layouts, round trips, a slow reference packer."""

from __future__ import annotations

import pytest
import torch

from compress.formats.packing import pack, packed_length, unpack


def as_u32(words: torch.Tensor) -> list[int]:
    return [int(w) & 0xFFFFFFFF for w in words.reshape(-1)]


def slow_pack(codes: list[int], bits: int) -> list[int]:
    """Textbook: one big integer, code k at bit k*bits, cut into 32-bit words (LSB first)."""
    stream = 0
    for k, c in enumerate(codes):
        stream |= c << (k * bits)
    n_words = -(-len(codes) * bits // 32)
    return [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(n_words)]


def test_golden_words_from_the_published_layouts():
    # compressed-tensors (formats.md §3.2): int4 q = -8..-1 (stored q + 8 = 0..7) -> 0x76543210
    assert as_u32(pack(torch.arange(8).unsqueeze(0), 4)) == [0x76543210]
    # int8 [-128, -1, 0, 127] stored +128 -> [0, 127, 128, 255] -> 0xff807f00
    assert as_u32(pack(torch.tensor([[0, 127, 128, 255]]), 8)) == [0xFF807F00]
    # GPTQ v1 symmetric 4-bit zeros: Z - 1 = 7 in every nibble
    assert as_u32(pack(torch.full((1, 8), 7), 4)) == [0x77777777]
    # 2-bit: 16 codes per word, code i at bits 2i
    assert as_u32(pack(torch.tensor([[1] + [0] * 14 + [3]]), 2)) == [0xC0000001]


def test_three_bit_split_across_words_like_autogptq():
    """32 three-bit codes fill 3 words: 10 codes, 1 split (2 low bits | 1 high bit), 10, 1 split, 10."""
    codes = torch.zeros(1, 32, dtype=torch.int64)
    codes[0, 10] = 0b101  # low two bits (01) end word 0, high bit (1) starts word 1
    codes[0, 21] = 0b110  # low bit (0) ends word 1, high two bits (11) start word 2
    codes[0, 31] = 0b111  # the last three bits of word 2
    assert as_u32(pack(codes, 3)) == [0b01 << 30, 0b1, 0b11 | (0b111 << 29)]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 5, 32, 33, 96, 100])
def test_matches_slow_reference_and_round_trips(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (3, n), generator=g)
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, packed_length(n, bits))
    for row in range(3):
        assert as_u32(words[row]) == slow_pack(codes[row].tolist(), bits)
    assert torch.equal(unpack(words, bits, n), codes.to(torch.int32))
    # Packing along dim 0 is packing the transpose along dim 1.
    assert torch.equal(pack(codes.t(), bits, dim=0), words.t())
    assert torch.equal(unpack(words.t(), bits, n, dim=0), codes.t().to(torch.int32))


def test_inputs_are_not_modified_and_bad_input_is_rejected():
    codes = torch.tensor([[1, 2, 3]])
    before = codes.clone()
    pack(codes, 2)
    assert torch.equal(codes, before)
    with pytest.raises(ValueError, match="lie in"):
        pack(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError, match="words"):
        unpack(torch.zeros(1, 2, dtype=torch.int32), 4, 8)
    with pytest.raises(ValueError, match="int32"):
        unpack(torch.zeros(1, 1, dtype=torch.int64), 4, 8)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_identical_to_compressed_tensors_pack_to_int32(bits):
    """The real consumer's packer (vllm-project/compressed-tensors) produces the same words."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    codes = torch.randint(0, 1 << bits, (6, 70), generator=torch.Generator().manual_seed(bits))
    signed = (codes - (1 << (bits - 1))).to(torch.int8)
    assert torch.equal(pack(codes, bits, dim=1), helpers.pack_to_int32(signed, bits, packed_dim=1))
    assert torch.equal(pack(codes, bits, dim=0), helpers.pack_to_int32(signed, bits, packed_dim=0))
