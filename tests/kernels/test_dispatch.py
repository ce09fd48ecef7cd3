"""QuantLinear's kernel dispatch: which path runs, and that the kernel path gives the reference's numbers."""

from __future__ import annotations

import functools

import pytest
import torch

from references import random_weight
from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.kernels import dispatch
from compress.kernels.quant_linear import QuantLinear
from compress.quantizers.grid import QuantScheme
from compress.quantizers.rtn import rtn

pytest.importorskip("triton")


def _ct_layer(bits: int = 4, symmetric: bool = False) -> QuantLinear:
    quant = rtn(random_weight((24, 64), seed=1), QuantScheme(bits, symmetric, 16))
    tensors = ct.pack_quantized_tensors(quant, torch.float32)
    deq = functools.partial(ct.dequantize_pack_quantized, bits=bits, symmetric=symmetric)
    return QuantLinear(64, 24, tensors, deq, bias=random_weight((24,), seed=2), layout=ct.PACK_QUANTIZED)


@pytest.mark.parametrize("rows", [1, 5, 40])  # fused path (<= 16 rows) and dequantize + F.linear (> 16)
def test_kernel_forward_gives_the_reference_forward(rows, monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNEL", raising=False)
    layer = _ct_layer()
    x = random_weight((rows, 64), seed=rows)
    y = dispatch.kernel_forward(layer, x)  # CPU tensors: Triton's interpreter stands in for the GPU
    if rows > 16:
        assert torch.equal(y, layer(x))  # same weight bits, same F.linear
    else:
        torch.testing.assert_close(y, layer(x), rtol=1e-5, atol=1e-4)


def test_cpu_forward_never_reaches_a_kernel(monkeypatch):
    def boom(*args):
        raise AssertionError("CPU input went to a kernel")

    monkeypatch.setattr(dispatch, "kernel_forward", boom)
    layer = _ct_layer()
    x = random_weight((2, 64), seed=3)
    torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().t() + layer.bias)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNEL", raising=False)
    assert dispatch.backend() is dispatch.KernelBackend.TRITON
    monkeypatch.setenv("COMPRESS_KERNEL", "reference")
    assert dispatch.kernel_forward(_ct_layer(), random_weight((1, 64), seed=4)) is None
    monkeypatch.setenv("COMPRESS_KERNEL", "marlin")
    with pytest.raises(CompressError, match="COMPRESS_KERNEL"):
        dispatch.backend()


def test_uncovered_layers_keep_the_reference(monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNEL", raising=False)
    assert dispatch.kernel_forward(_ct_layer(bits=3), random_weight((1, 64), seed=5)) is None
