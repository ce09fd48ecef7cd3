"""Which kernel a `QuantLinear` forward uses: CUDA input -> Triton (or the CUDA C++ dequant; float layouts:
Triton only); CPU -> the torch reference. ``COMPRESS_KERNEL`` (`KernelBackend` value) overrides the choice; layers no kernel covers
(W8A8, 3-bit, unknown layouts) keep the reference. Every path dequantizes to the same bits (layouts.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from enum import Enum

import torch
from torch import nn

from compress.errors import CompressError
from compress.kernels.layouts import FloatPacked, GroupPacked, describe_layer

log = logging.getLogger(__name__)


class KernelBackend(str, Enum):
    TRITON = "triton"
    CUDA = "cuda"
    REFERENCE = "reference"


def backend() -> KernelBackend:
    value = os.environ.get("COMPRESS_KERNEL")
    if value:
        try:
            return KernelBackend(value)
        except ValueError:
            choices = ", ".join(b.value for b in KernelBackend)
            raise CompressError(f"COMPRESS_KERNEL={value!r} is not a kernel backend: use one of {choices}") from None
    return KernelBackend.TRITON if importlib.util.find_spec("triton") else KernelBackend.CUDA


def _descriptor(layer) -> GroupPacked | FloatPacked | None:
    """`describe_layer`, cached on the layer for its current buffers (the g_idx check syncs the GPU)."""
    key = tuple((t.data_ptr(), t.device) for t in layer.packed_tensors().values())
    cached = layer.__dict__.get("_kernel_descriptor")
    if cached is None or cached[0] != key:
        cached = (key, describe_layer(layer))
        layer.__dict__["_kernel_descriptor"] = cached
    return cached[1]


def kernel_forward(layer, x: torch.Tensor) -> torch.Tensor | None:
    """``layer(x)`` through a GPU kernel, or None when the reference must run."""
    choice = backend()
    if choice is KernelBackend.REFERENCE:
        return None
    desc = _descriptor(layer)
    if desc is None or desc.device != x.device:
        return None
    if isinstance(desc, FloatPacked):  # float layouts: Triton only
        if choice is not KernelBackend.TRITON:
            return None
        from compress.kernels import triton_float

        return triton_float.matmul(x, desc, layer.bias)
    if choice is KernelBackend.TRITON:
        from compress.kernels import triton_int

        return triton_int.matmul(x, desc, layer.bias)
    from compress.kernels import cuda_ext

    weight = cuda_ext.dequantize(desc).to(x.dtype)
    return nn.functional.linear(x, weight, None if layer.bias is None else layer.bias.to(x.dtype))
