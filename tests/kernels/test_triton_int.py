"""Triton int group kernels against the torch references in formats/ (interpreter, CPU, tiny odd shapes)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import CT_CASES, GPTQ_CASES, int_layer
from references import random_weight
from compress.kernels.layouts import describe_layer
from compress.kernels.quant_linear import QuantLinear

triton_int = pytest.importorskip("compress.kernels.triton_int")


@pytest.mark.parametrize("unpack", [True, False])  # codes split from each loaded word; each code loading its word
@pytest.mark.parametrize("bits,symmetric,group_size,shape", CT_CASES)
def test_pack_quantized_dequant_is_bit_exact(bits, symmetric, group_size, shape, unpack):
    tensors, reference, desc = int_layer("pack-quantized", bits, symmetric, group_size, shape)
    for block_k in (32, 64):  # with groups of 16, 32, 64: tiles inside one group, and tiles spanning groups
        assert torch.equal(triton_int.dequantize(desc, block_k=block_k, unpack=unpack), reference(tensors))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits,symmetric,group_size,shape", GPTQ_CASES)
def test_gptq_dequant_is_bit_exact(bits, symmetric, group_size, shape, act_order):
    if act_order and group_size == -1:
        pytest.skip("one group: every g_idx is 0")
    tensors, reference, desc = int_layer("gptq", bits, symmetric, group_size, shape, act_order=act_order)
    assert (desc.g_idx is not None) == act_order
    for unpack in (True, False):
        assert torch.equal(triton_int.dequantize(desc, unpack=unpack), reference(tensors).contiguous())


def test_dequant_to_half_is_the_reference_rounded_once():
    tensors, reference, desc = int_layer("pack-quantized", 4, False, 16, (20, 48))
    assert torch.equal(triton_int.dequantize(desc, torch.bfloat16), reference(tensors).to(torch.bfloat16))


# (kernel, block settings): the fused GEMM with the plain store and the atomic split-K reduction; gemv with
# block_k 16 inside every group (scale and zero factored out, no g_idx) and 32 across groups of 16
KERNEL_RUNS = {
    "fused": [dict(block_n=32, block_k=32, split_k=s, unpack=u) for s, u in ((1, True), (2, True), (2, False))],
    "gemv": [dict(block_n=16, block_k=k, split_k=s, unpack=u) for k, s, u in ((16, 1, True), (16, 3, True), (32, 2, True),
                                                                             (32, 1, False))],
}


@pytest.mark.parametrize("layout,bits,symmetric,group_size,shape", [
    ("pack-quantized", 4, True, 16, (37, 80)), ("pack-quantized", 4, False, 32, (24, 160)),
    ("pack-quantized", 8, False, 64, (20, 128)), ("pack-quantized", 2, True, 32, (33, 64)),
    ("gptq", 4, False, 16, (40, 80)), ("gptq", 8, True, 32, (32, 96)),
])
@pytest.mark.parametrize("kernel,m", [("fused", 1), ("fused", 3), ("fused", 16), ("gemv", 1), ("gemv", 3), ("gemv", 4)])
def test_small_batch_kernels_match_reference(layout, bits, symmetric, group_size, shape, kernel, m):
    tensors, reference, desc = int_layer(layout, bits, symmetric, group_size, shape, act_order=layout == "gptq")
    x = random_weight((m, shape[1]), seed=m)
    expected = x.double() @ reference(tensors).double().t()
    run = triton_int.fused_matmul if kernel == "fused" else triton_int.gemv
    for settings in KERNEL_RUNS[kernel]:
        torch.testing.assert_close(run(x, desc, **settings).double(), expected, rtol=1e-5, atol=1e-4)


def test_gemv_half_activations_and_the_batch_limit():
    tensors, reference, desc = int_layer("pack-quantized", 4, False, 32, (24, 96))
    x = random_weight((1, 96), seed=8).to(torch.bfloat16)
    expected = x.double() @ reference(tensors).double().t()  # the exact weight: gemv does not round it to bf16
    y = triton_int.gemv(x, desc, block_n=16, block_k=32)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), expected.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="M <= 4"):
        triton_int.gemv(random_weight((5, 96), seed=1), desc)


def test_matmul_large_batch_path_and_bias():
    tensors, reference, desc = int_layer("pack-quantized", 4, False, 16, (24, 64))
    x, bias = random_weight((2, 20, 64), seed=3), random_weight((24,), seed=4)  # 40 rows: the dequant+matmul path
    torch.testing.assert_close(triton_int.matmul(x, desc, bias), x @ reference(tensors).t() + bias, rtol=1e-5, atol=1e-4)


def test_quant_linear_kernel_forward_matches_its_reference_forward():
    tensors, reference, _ = int_layer("gptq", 4, False, 16, (40, 80), act_order=True)
    layer = QuantLinear(80, 40, tensors, reference, bias=random_weight((40,), seed=5), layout="gptq")
    desc = describe_layer(layer)
    assert desc is not None and desc.g_idx is not None
    x = random_weight((2, 80), seed=6)
    torch.testing.assert_close(triton_int.matmul(x, desc, layer.bias), layer(x), rtol=1e-5, atol=1e-4)


def test_widths_without_a_kernel_keep_the_reference():
    tensors, reference, desc = int_layer("pack-quantized", 3, True, 16, (8, 64))
    assert desc is None
    assert describe_layer(QuantLinear(64, 8, tensors, reference, layout="pack-quantized")) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_matmul_half_activations(dtype):
    tensors, reference, desc = int_layer("pack-quantized", 4, False, 32, (24, 96))
    x = random_weight((4, 96), seed=8).to(dtype)
    expected = x.float() @ reference(tensors).to(dtype).float().t()  # the weight in x's dtype, fp32 accumulation
    y = triton_int.fused_matmul(x, desc, block_n=32, block_k=32, split_k=2)
    assert y.dtype == dtype
    torch.testing.assert_close(y, expected.to(dtype))
