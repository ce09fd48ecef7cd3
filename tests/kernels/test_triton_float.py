"""Triton float dequant kernels against the torch references in formats/ct_float.py and torch's own float8
view (interpreter, CPU, odd shapes: partial row blocks, rows not a multiple of the tile, K not of BLOCK_K)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import FLOAT_CASES, float_layer
from references import random_weight
from compress.formats import ct_float
from compress.kernels.layouts import FloatPacked, describe_float, describe_layer
from compress.kernels.quant_linear import QuantLinear
from compress.quantizers.float_grid import FloatGrid

triton_float = pytest.importorskip("compress.kernels.triton_float")


@pytest.mark.parametrize("name", sorted(FLOAT_CASES))
def test_dequant_is_bit_exact(name):
    tensors, reference, desc = float_layer(name)
    expected = reference(tensors)
    assert torch.equal(triton_float.dequantize(desc), expected)
    assert torch.equal(triton_float.dequantize(desc, torch.bfloat16), expected.to(torch.bfloat16))  # rounded once


def test_every_e4m3_byte_and_every_fp4_scale_byte():
    """All 256 E4M3 bytes (NaN included) against torch's float8 view; all E4M3 scale bytes under a global scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).view(torch.float8_e4m3fn)
    desc = FloatPacked(FloatGrid.FP8, codes, torch.ones(1), None, 16, 16, 16, 16)
    out, expected = triton_float.dequantize(desc), codes.float()
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out[~out.isnan()], expected[~expected.isnan()])
    scale_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = ~scale_bytes.view(torch.float8_e4m3fn).float().isnan()
    tensors = {
        "weight_packed": torch.full((int(finite.sum()), 8), 0x72, dtype=torch.uint8),  # 1.0 and 6.0
        "weight_scale": scale_bytes[finite].view(torch.float8_e4m3fn).reshape(-1, 1),
        "weight_global_scale": torch.tensor([2986.6667]),
    }
    desc = describe_float(tensors, FloatGrid.NVFP4)
    assert desc.col_block == 16
    assert torch.equal(triton_float.dequantize(desc), ct_float.dequantize_fp4(tensors, FloatGrid.NVFP4))


def test_quant_linear_kernel_forward_matches_its_reference_forward():
    import functools

    tensors, _, _ = float_layer("nvfp4", seed=3)
    dequantize = functools.partial(ct_float.dequantize_fp4, grid=FloatGrid.NVFP4)
    layer = QuantLinear(80, 37, tensors, dequantize, bias=random_weight((37,), seed=5), layout="nvfp4-pack-quantized")
    desc = describe_layer(layer)
    assert isinstance(desc, FloatPacked) and desc.grid is FloatGrid.NVFP4
    x = random_weight((3, 80), seed=6)
    assert torch.equal(triton_float.matmul(x, desc, layer.bias), layer(x))  # the same weight bits, the same F.linear
    with_inputs = QuantLinear(80, 37, tensors, dequantize, activations=object(), layout="nvfp4-pack-quantized")
    assert describe_layer(with_inputs) is None  # activation-quantizing layers keep the reference
