"""Integer activation quantization (the "A8" of W8A8), simulated in float.

SmoothQuant (Xiao et al. 2022, arXiv:2211.10438) runs linear layers on int8 inputs. A linear layer's
input ``x [..., in_features]`` is quantized symmetrically, ``x ≈ s · q`` with ``q`` in
``[−(2**(bits−1) − 1), 2**(bits−1) − 1]`` (the restricted range int8 GEMMs use):

- per token, dynamic: one scale per token vector, ``s = max_j |x_j| / qmax``, computed at run time;
- per tensor, static: one scale calibrated offline (``s = max |X| / qmax`` over calibration data) and
  stored beside the weight as ``input_scale``; values beyond it saturate.

`quantize_activations` returns the dequantized input, so a float matmul on it computes exactly what
an int8 GEMM followed by rescaling computes (up to float accumulation order).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ActGranularity(str, enum.Enum):
    TOKEN = "token"
    TENSOR = "tensor"


@dataclass(frozen=True)
class ActivationScheme:
    bits: int = 8
    granularity: ActGranularity = ActGranularity.TOKEN
    dynamic: bool = True
    symmetric: bool = True

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"activation bits must be between 2 and 8, got {self.bits}")
        if not self.symmetric:
            raise ValueError("only symmetric activation quantization is supported")
        if self.granularity == ActGranularity.TOKEN and not self.dynamic:
            raise ValueError("per-token activation scales are dynamic by nature: use dynamic=True")
        if self.granularity == ActGranularity.TENSOR and self.dynamic:
            raise ValueError("dynamic per-tensor activation scales are not supported: use per-token")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def to_record(self) -> dict:
        return {"bits": self.bits, "granularity": self.granularity.value, "dynamic": self.dynamic, "symmetric": self.symmetric}

    @classmethod
    def from_record(cls, record: dict) -> "ActivationScheme":
        return cls(int(record["bits"]), ActGranularity(record["granularity"]), bool(record["dynamic"]), bool(record["symmetric"]))


def static_scale(absmax: torch.Tensor | float, scheme: ActivationScheme) -> torch.Tensor:
    """The per-tensor scale for inputs whose calibrated absolute maximum is ``absmax``."""
    value = torch.as_tensor(absmax, dtype=torch.float32).max()
    return torch.clamp(value / scheme.qmax, min=torch.finfo(torch.float32).tiny)


def quantize_activations(x: torch.Tensor, scheme: ActivationScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize ``x [..., in]``: round to the int grid and scale back, in ``x``'s dtype."""
    xf = x.float()
    if scheme.dynamic:
        s = xf.abs().amax(dim=-1, keepdim=True) / scheme.qmax
        s = torch.where(s > 0, s, torch.ones_like(s))
    else:
        if scale is None:
            raise ValueError("static activation quantization needs the calibrated input_scale")
        s = scale.to(device=x.device, dtype=torch.float32)
    q = torch.clamp(torch.round(xf / s), -scheme.qmax, scheme.qmax)
    return (q * s).to(x.dtype)
