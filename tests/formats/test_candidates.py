"""Candidate names and stored sizes, against the bytes the real writers produce."""

from __future__ import annotations

import pytest
import torch

from compress.errors import CompressError
from compress.formats.candidates import parse_candidate, parse_candidates
from compress.formats.compressed_tensors import pack_quantized_tensors
from compress.formats.gguf.codecs import encode_tensor
from compress.formats.gguf.sizes import GGMLType
from compress.quantizers.rtn import rtn


@pytest.mark.parametrize("name", ["w2g64", "w3g128", "w4g32", "w8", "w5g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_sizes_equal_the_packed_tensors(name, dtype):
    candidate = parse_candidate(name)
    weight = torch.randn(96, 256)
    tensors = pack_quantized_tensors(rtn(weight, candidate.scheme), dtype)  # what compressed-tensors output stores
    assert candidate.stored_bytes(96, 256, dtype.itemsize) == sum(t.numel() * t.element_size() for t in tensors.values())


def test_group_that_does_not_divide_cannot_store():
    assert parse_candidate("w4g128").stored_bytes(64, 576) is None
    assert parse_candidate("w4").stored_bytes(64, 576) is not None


@pytest.mark.parametrize("name, cols, written", [
    ("q4_k", 256, GGMLType.Q4_K), ("q8_0", 64, GGMLType.Q8_0), ("q6_k", 256, GGMLType.Q6_K),
    ("q4_k", 576, GGMLType.Q5_0),  # llama.cpp's fallback for rows that do not split into 256-blocks
    ("q3_k", 64, GGMLType.Q4_0), ("q2_k", 48, GGMLType.F16),
])
def test_gguf_sizes_equal_the_encoded_bytes(name, cols, written):
    candidate = parse_candidate(name)
    assert candidate.stored_type(cols) == written
    data = encode_tensor(torch.randn(8, cols).numpy(), written)
    assert candidate.stored_bytes(8, cols) == data.nbytes


@pytest.mark.parametrize("text, needle", [
    ("w9g128", "bits"), ("w4g0", "group"), ("q4_k_m", "unknown candidate"), ("int4", "unknown candidate"),
    ("w4g128,q4_k", "mix"), ("", "no candidates"),
])
def test_bad_candidates_are_one_line_errors(text, needle):
    with pytest.raises(CompressError) as info:
        parse_candidates(text)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_lists_parse_in_order_without_duplicates():
    assert [c.name for c in parse_candidates("W4G128, w2g64,w4g128")] == ["w4g128", "w2g64"]
