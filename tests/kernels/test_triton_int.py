"""Triton int group kernels against the torch references in formats/ (interpreter, CPU, tiny odd shapes)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from references import random_weight
from compress.formats import compressed_tensors as ct
from compress.formats import gptq
from compress.kernels.layouts import describe_gptq, describe_layer, describe_pack_quantized
from compress.kernels.quant_linear import QuantLinear
from compress.quantizers.grid import QuantScheme
from compress.quantizers.rtn import rtn

triton_int = pytest.importorskip("compress.kernels.triton_int")


def _layer(layout: str, bits: int, symmetric: bool, group_size: int, shape, seed: int = 0, act_order: bool = False):
    """(tensors, reference dequantizer, descriptor) of a random weight in ``layout``."""
    quant = rtn(random_weight(shape, seed=seed), QuantScheme(bits, symmetric, group_size))
    if layout == "gptq":
        if act_order:  # a permuted column -> group map, as act-order checkpoints store
            width = shape[1] if group_size == -1 else group_size
            g = torch.arange(shape[1]) // width
            quant = dataclasses.replace(quant, g_idx=g[torch.randperm(shape[1], generator=torch.Generator().manual_seed(seed))])
        tensors = gptq.gptq_tensors(quant)
        return tensors, functools.partial(gptq.dequantize, bits=bits, group_size=group_size), describe_gptq(tensors, bits, group_size)
    tensors = ct.pack_quantized_tensors(quant, torch.bfloat16)
    return tensors, functools.partial(ct.dequantize_pack_quantized, bits=bits, symmetric=symmetric), describe_pack_quantized(tensors, bits, symmetric)


# odd shapes: rows not a multiple of the tile, a single group, K not a multiple of BLOCK_K (64)
CT_CASES = [(4, True, 16, (37, 80)), (4, False, 16, (40, 80)), (8, True, -1, (5, 36)), (8, False, 12, (8, 36)),
            (2, False, -1, (33, 96)), (4, True, -1, (3, 200))]
GPTQ_CASES = [(4, True, 32, (32, 96)), (4, False, 16, (40, 80)), (8, False, -1, (8, 36)), (2, True, 64, (48, 128))]


@pytest.mark.parametrize("bits,symmetric,group_size,shape", CT_CASES)
def test_pack_quantized_dequant_is_bit_exact(bits, symmetric, group_size, shape):
    tensors, reference, desc = _layer("pack-quantized", bits, symmetric, group_size, shape)
    out = triton_int.dequantize(desc)
    assert torch.equal(out, reference(tensors))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits,symmetric,group_size,shape", GPTQ_CASES)
def test_gptq_dequant_is_bit_exact(bits, symmetric, group_size, shape, act_order):
    if act_order and group_size == -1:
        pytest.skip("one group: every g_idx is 0")
    tensors, reference, desc = _layer("gptq", bits, symmetric, group_size, shape, act_order=act_order)
    assert (desc.g_idx is not None) == act_order
    assert torch.equal(triton_int.dequantize(desc), reference(tensors).contiguous())


def test_dequant_to_half_is_the_reference_rounded_once():
    tensors, reference, desc = _layer("pack-quantized", 4, False, 16, (20, 48))
    assert torch.equal(triton_int.dequantize(desc, torch.bfloat16), reference(tensors).to(torch.bfloat16))


@pytest.mark.parametrize("layout,bits,symmetric,group_size,shape", [
    ("pack-quantized", 4, True, 16, (37, 80)), ("pack-quantized", 4, False, 32, (24, 160)),
    ("gptq", 4, False, 16, (40, 80)), ("gptq", 8, True, 32, (32, 96)),
])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fused_matmul_matches_reference(layout, bits, symmetric, group_size, shape, m):
    tensors, reference, desc = _layer(layout, bits, symmetric, group_size, shape, act_order=layout == "gptq")
    x = random_weight((m, shape[1]), seed=m)
    expected = x.double() @ reference(tensors).double().t()
    for split_k in (1, 2):  # the plain store and the atomic split-K reduction
        y = triton_int.fused_matmul(x, desc, block_n=32, block_k=32, split_k=split_k)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_matmul_large_batch_path_and_bias():
    tensors, reference, desc = _layer("pack-quantized", 4, False, 16, (24, 64))
    x, bias = random_weight((2, 20, 64), seed=3), random_weight((24,), seed=4)  # 40 rows: the dequant+matmul path
    torch.testing.assert_close(triton_int.matmul(x, desc, bias), x @ reference(tensors).t() + bias, rtol=1e-5, atol=1e-4)


def test_quant_linear_kernel_forward_matches_its_reference_forward():
    tensors, reference, _ = _layer("gptq", 4, False, 16, (40, 80), act_order=True)
    layer = QuantLinear(80, 40, tensors, reference, bias=random_weight((40,), seed=5), layout="gptq")
    desc = describe_layer(layer)
    assert desc is not None and desc.g_idx is not None
    x = random_weight((2, 80), seed=6)
    torch.testing.assert_close(triton_int.matmul(x, desc, layer.bias), layer(x), rtol=1e-5, atol=1e-4)


def test_widths_without_a_kernel_keep_the_reference():
    tensors, reference, desc = _layer("pack-quantized", 3, True, 16, (8, 64))
    assert desc is None
    assert describe_layer(QuantLinear(64, 8, tensors, reference, layout="pack-quantized")) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_matmul_half_activations(dtype):
    tensors, reference, desc = _layer("pack-quantized", 4, False, 32, (24, 96))
    x = random_weight((4, 96), seed=8).to(dtype)
    expected = x.float() @ reference(tensors).to(dtype).float().t()  # the weight in x's dtype, fp32 accumulation
    y = triton_int.fused_matmul(x, desc, block_n=32, block_k=32, split_k=2)
    assert y.dtype == dtype
    torch.testing.assert_close(y, expected.to(dtype))
