"""`QuantLinear`: a Linear layer that keeps its packed tensors and dequantizes them on every forward.

The packed tensors are registered as buffers under their checkpoint names (``weight_packed``,
``weight_scale``, ... or ``qweight``, ``qzeros``, ``scales``, ``g_idx``), so ``state_dict()`` has
the keys of the file it was loaded from. ``forward(x [..., in]) -> [..., out]``:

    W = dequantize(tensors)            # float32 [out, in], the layout's torch reference
    x = quantize_activations(x, ...)   # only for W8A8 checkpoints (dynamic per token or static per tensor)
    y = x @ W.T + bias

This is the reference path (slow, memory of one dense weight per call), the one CPU inputs take; CUDA inputs
go to the Triton / CUDA kernels of kernels/dispatch.py where one covers the layout (same weight bits).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

Dequantizer = Callable[[dict[str, torch.Tensor]], torch.Tensor]


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        tensors: dict[str, torch.Tensor],
        dequantize: Dequantizer,
        bias: torch.Tensor | None = None,
        activations=None,
        layout: str = "",
    ):
        """``dequantize(tensors) -> [out, in]``; ``activations`` an `ActivationScheme` (W8A8, FP8, W4A4) or None;
        a static scheme reads its scale from the ``input_scale`` (NVFP4: ``input_global_scale``) tensor."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.layout = layout
        self._dequantize = dequantize
        self._names = list(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.activations = activations
        self.quantizes_input = activations is not None  # tells evaluation's W8A8 hooks to leave this layer alone

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._names}

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the packed tensors encode."""
        return self._dequantize(self.packed_tensors())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is not None:
            from compress.quantizers.activations import quantize_activations

            static = getattr(self, "input_scale", getattr(self, "input_global_scale", None))  # NVFP4: the global scale
            x = quantize_activations(x, self.activations, static)
        elif x.is_cuda:  # GPU: a Triton / CUDA kernel where one covers the layout (kernels/dispatch.py)
            from compress.kernels.dispatch import kernel_forward

            y = kernel_forward(self, x)
            if y is not None:
                return y
        weight = self.dequantized_weight().to(device=x.device, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout}"
