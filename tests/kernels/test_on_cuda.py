"""The kernels compiled for a real GPU, against the torch references run on the CPU (the independent side).

The other kernel tests run Triton's interpreter on CPU tensors; this module runs only where a CUDA device
is present and the interpreter is off (``TRITON_INTERPRET=0 python -m pytest tests/kernels/test_on_cuda.py``;
bench/gpu_check.sh runs it on the lent GPU machine). Every layout, through the production path: the
layer's buffers moved to the GPU, `describe_layer`, the Triton dequant (bit-exact), the fused GEMM and
`QuantLinear.forward` (close to the float64 product), the CUDA C++ dequant (bit-exact), and every GGUF block
type against gguf-py.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from kernel_cases import CT_CASES, FLOAT_CASES, GPTQ_CASES, float_layer, int_layer, random_blocks
from references import random_weight
from compress.kernels.layouts import describe_layer
from compress.kernels.quant_linear import QuantLinear

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device with Triton's interpreter off (TRITON_INTERPRET=0)",
)
triton_gguf = pytest.importorskip("compress.kernels.triton_gguf")

INT_CASES = [("pack-quantized", *case) for case in CT_CASES] + [
    ("gptq", *case) for case in GPTQ_CASES
]


def _on_gpu(layer: QuantLinear) -> QuantLinear:
    return copy.deepcopy(layer).to("cuda")  # Module.to moves in place: keep the CPU layer for the reference


def _int_layer(layout, bits, symmetric, group_size, shape):
    act_order = layout == "gptq" and group_size != -1
    tensors, reference, _ = int_layer(layout, bits, symmetric, group_size, shape, act_order=act_order)
    bias = random_weight((shape[0],), seed=5)
    return QuantLinear(shape[1], shape[0], tensors, reference, bias=bias, layout=layout), reference(tensors)


@pytest.mark.parametrize("layout,bits,symmetric,group_size,shape", INT_CASES)
def test_int_layouts_on_the_gpu(layout, bits, symmetric, group_size, shape, monkeypatch):
    from compress.kernels import triton_int

    monkeypatch.delenv("COMPRESS_KERNEL", raising=False)
    layer, expected = _int_layer(layout, bits, symmetric, group_size, shape)
    gpu = _on_gpu(layer)
    desc = describe_layer(gpu)
    assert desc is not None and desc.device.type == "cuda"
    assert torch.equal(triton_int.dequantize(desc).cpu(), expected.contiguous())  # the autotuned tile
    for unpack in (True, False):
        assert torch.equal(triton_int.dequantize(desc, block_k=64, unpack=unpack).cpu(), expected.contiguous())
    for rows in (1, 3, 16, 40):  # gemv (<= 4 rows), the fused GEMM (<= 16) and dequantize + matmul
        x = random_weight((rows, shape[1]), seed=rows)
        want = (x.double() @ expected.double().t() + layer.bias.double()).float()
        torch.testing.assert_close(gpu(x.cuda()).cpu(), want, rtol=1e-4, atol=1e-3)
    for block_k, split_k in ((16, 1), (32, 2), (64, 3)):  # gemv: inside one group (factored) and across groups
        x = random_weight((3, shape[1]), seed=11)
        y = triton_int.gemv(x.cuda(), desc, block_n=16, block_k=block_k, split_k=split_k)
        torch.testing.assert_close(y.cpu().double(), x.double() @ expected.double().t(), rtol=1e-4, atol=1e-3)
    for split_k, unpack in ((1, True), (2, True), (2, False)):
        x = random_weight((5, shape[1]), seed=9)
        y = triton_int.fused_matmul(x.cuda(), desc, block_n=32, block_k=32, split_k=split_k, unpack=unpack)
        torch.testing.assert_close(y.cpu().double(), x.double() @ expected.double().t(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("layout,bits,symmetric,group_size,shape", INT_CASES)
def test_cuda_cpp_dequant_is_bit_exact(layout, bits, symmetric, group_size, shape):
    from compress.kernels import cuda_ext

    layer, expected = _int_layer(layout, bits, symmetric, group_size, shape)
    desc = describe_layer(_on_gpu(layer))
    assert torch.equal(cuda_ext.dequantize(desc).cpu(), expected.contiguous())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int_half_activations(dtype):
    layer, expected = _int_layer("pack-quantized", 4, False, 32, (24, 96))
    gpu = _on_gpu(layer)
    x = random_weight((4, 96), seed=8).to(dtype)
    want = x.float() @ expected.to(dtype).float().t() + layer.bias.to(dtype).float()
    y = gpu.to(dtype)(x.cuda())
    assert y.dtype == dtype
    torch.testing.assert_close(y.cpu().float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", sorted(FLOAT_CASES))
def test_float_layouts_on_the_gpu(name):
    from compress.kernels import triton_float
    from compress.kernels.layouts import describe_float
    from compress.quantizers.float_grid import FloatGrid

    tensors, reference, _ = float_layer(name)
    expected = reference(tensors)
    scheme, _ = FLOAT_CASES[name]
    block = (scheme.block_rows, scheme.group_size) if scheme.grid is FloatGrid.FP8 and scheme.block_rows > 1 else None
    gpu_desc = describe_float({k: v.cuda() for k, v in tensors.items()}, scheme.grid, block)
    assert torch.equal(triton_float.dequantize(gpu_desc).cpu(), expected)
    assert torch.equal(triton_float.dequantize(gpu_desc, torch.bfloat16).cpu(), expected.to(torch.bfloat16))
    for rows in (1, 7, 40):
        x = random_weight((rows, expected.shape[1]), seed=rows)
        y = triton_float.matmul(x.cuda(), gpu_desc, None).cpu()
        torch.testing.assert_close(y.double(), x.double() @ expected.double().t(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("block", list(triton_gguf.GGUFBlock))
def test_gguf_blocks_on_the_gpu(block):
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    data = random_blocks(block, 37, seed=11)
    expected = gguf_quants.dequantize(data, GGMLQuantizationType[block.name]).reshape(-1).astype(np.float32)
    out = triton_gguf.dequantize(torch.from_numpy(data).cuda(), block).cpu().numpy()
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_the_autotuned_kernels_on_a_real_layer():
    """A 1024 x 2048 layer (at least TUNE_MIN_WEIGHTS): the autotuner's tiles give the same weight bits."""
    from compress.kernels import triton_int

    layer, expected = _int_layer("pack-quantized", 4, False, 128, (1024, 2048))
    gpu = _on_gpu(layer)
    desc = describe_layer(gpu)
    assert desc.out_features * desc.in_features >= triton_int.TUNE_MIN_WEIGHTS
    assert torch.equal(triton_int.dequantize(desc).cpu(), expected)
    for rows in (1, 4, 16, 40):
        x = random_weight((rows, 2048), seed=rows)
        want = (x.double() @ expected.double().t() + layer.bias.double()).float()
        torch.testing.assert_close(gpu(x.cuda()).cpu(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("n, b", [(1536, 512), (1536, 1536), (4096, 4096)])
def test_the_online_rotation_kernel_on_the_gpu(n, b):
    """`compress.checkpoints.transforms.rotate_input` on CUDA (the Triton kernel) against the torch reference on
    the CPU: Sylvester blocks (SmolLM2's 1536 = 3 × 512), one Paley-Kronecker block, a power of two."""
    from compress.checkpoints.transforms import rotate_input
    from compress.quantizers.hadamard import random_hadamard, sylvester
    from compress.quantizers.rotation import online_rotation

    h = (sylvester(b) if b & (b - 1) == 0 else torch.sign(random_hadamard(b, 1))).float()
    x = torch.randn(37, n, generator=torch.Generator().manual_seed(0))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -8)):
        got = rotate_input(x.to(dtype).cuda(), h.cuda()).cpu()
        assert torch.allclose(got.float(), online_rotation(x.to(dtype), h).float(), rtol=tolerance, atol=tolerance)


def test_autoround_on_cuda_takes_the_cpu_steps():
    """The signed-gradient steps on a CUDA layer (float64 gradient sums kept on the layer's device) land on the CPU's
    codes: SignSGD moves by the sign, which float32 rounding on another device rarely flips."""
    from compress.quantizers.autoround import AutoRoundConfig, autoround_linear
    from compress.quantizers.grid import QuantScheme

    g = torch.Generator().manual_seed(0)
    w, xs = torch.randn(32, 128, generator=g) * 0.05, [torch.randn(16, 128, generator=g) for _ in range(8)]
    config, grid = AutoRoundConfig(iters=10, batch_size=4), QuantScheme(4, True, 64)
    cpu = autoround_linear(w, xs, config, grid).layers["weight"]
    gpu = autoround_linear(w.cuda(), [x.cuda() for x in xs], config, grid).layers["weight"]
    assert (gpu.codes.cpu() != cpu.codes).float().mean() < 0.01
