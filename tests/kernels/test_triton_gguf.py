"""Triton GGUF block kernels against gguf-py's dequantize (the ggml reference) and formats/gguf's decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_cases import random_blocks
from references import random_weight

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

triton_gguf = pytest.importorskip("compress.kernels.triton_gguf")
GGUFBlock = triton_gguf.GGUFBlock


@pytest.mark.parametrize("block", list(GGUFBlock))
@pytest.mark.parametrize("n_blocks", [1, 3, 9])  # one block; counts that leave a partly empty program
def test_random_blocks_match_gguf_py_bit_for_bit(block, n_blocks):
    data = random_blocks(block, n_blocks, seed=n_blocks)
    expected = gguf_quants.dequantize(data, GGMLQuantizationType[block.name]).reshape(-1)
    out = triton_gguf.dequantize(torch.from_numpy(data), block).numpy()
    np.testing.assert_array_equal(out.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("block", list(GGUFBlock))
def test_encoded_weight_matches_gguf_py_and_our_decoder(block):
    codecs = pytest.importorskip("compress.formats.gguf.codecs")
    from compress.formats.gguf.sizes import GGMLType

    elems = block.elems
    weight = random_weight((3, 2 * elems), seed=7).numpy()  # 3 rows of 2 blocks
    data = codecs.encode_tensor(weight, GGMLType[block.name])
    out = triton_gguf.dequantize(torch.from_numpy(np.ascontiguousarray(data)), block).numpy().reshape(3, -1)
    np.testing.assert_array_equal(out, gguf_quants.dequantize(data, GGMLQuantizationType[block.name]).reshape(3, -1))
    np.testing.assert_array_equal(out, codecs.decode_tensor(data, GGMLType[block.name], 2 * elems))
    assert np.abs(out - weight).max() < 0.5 * np.abs(weight).max()  # sanity: it is the weight, coarsely


def test_rejects_partial_blocks():
    with pytest.raises(ValueError, match="whole blocks"):
        triton_gguf.dequantize(torch.zeros(19, dtype=torch.uint8), GGUFBlock.Q4_0)


def test_iq4_codebook_is_gguf_py_table():
    assert list(triton_gguf.IQ4_KVALUES) == list(gguf_quants.IQ4_NL.kvalues)
