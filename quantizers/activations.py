"""Integer activation quantization (the "A8" of W8A8), simulated in float.

SmoothQuant (Xiao et al. 2022, arXiv:2211.10438) runs linear layers on int8 inputs. A linear layer's
input ``x [..., in_features]`` is quantized symmetrically, ``x ≈ s · q`` with ``q`` in
``[−(2**(bits−1) − 1), 2**(bits−1) − 1]`` (the restricted range int8 GEMMs use; narrower dynamic ints below):

- per token, dynamic: one scale per token vector, computed at run time as each width's consumer computes it:
  int8 as vLLM's dynamic int8 kernels, ``s = max_j |x_j| / 127`` with codes ``±127``; narrower ints (int4: W4A4),
  which no vLLM kernel runs and compressed-tensors' own quantized forward does, as its symmetric min-max
  qparams, ``s = max_j |x_j| / ((2**bits − 1) / 2)`` (7.5 at 4 bits) with the whole range of codes (``−8 … 7``);
- per tensor, static: one scale calibrated offline (``s = max |X| / qmax`` over calibration data) and
  stored beside the weight as ``input_scale``; values beyond it saturate to the whole int8 range
  ``[−2**(bits−1), 2**(bits−1) − 1]``, as the consumers' kernels do (vLLM's ``static_scaled_int8_quant``,
  compressed-tensors' int8 range): a negative input below the calibrated range reaches ``−128 · s``.

Rounding is to nearest, ties to even, of ``x / s`` in float32, the dynamic scale in float32: for int8 what vLLM's
CPU kernels (``dynamic_scaled_int8_quant``, ``static_scaled_int8_quant``) compute for a float32 model, element for
element (bench/vllm_check.py compares the two end to end).

`quantize_activations` returns the dequantized input, so a float matmul on it computes exactly what
an int8 GEMM followed by rescaling computes (up to float accumulation order).

Float activations (``type=float``, the FP8/FP4 GEMMs of serving engines; compressed-tensors' presets) use
the float grids of ``float_grid`` on the ``[tokens, in]`` view, scales computed as those grids compute them:

- FP8 E4M3: per token (dynamic, ``s = max_j |x_j| / 448``), per tensor (static, calibrated ``input_scale``),
  or per group of ``group_size`` columns of each token (dynamic; FP8 block checkpoints use 128);
- NVFP4: per 16 columns of each token an E4M3 scale computed at run time, under a per-tensor global scale
  calibrated offline (``input_global_scale = 448 · 6 / max |X|``, compressed-tensors' ``dynamic: local``);
- MXFP4: per 32 columns of each token a power-of-two scale computed at run time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from compress.quantizers.float_grid import FloatFormat, FloatGrid, FloatScheme, nvfp4_global_scale
from compress.quantizers.grid import divide


class ActGranularity(str, enum.Enum):
    TOKEN = "token"
    TENSOR = "tensor"
    GROUP = "group"  # groups of columns within each token (float types)


class ActType(str, enum.Enum):
    INT = "int"
    FLOAT = "float"  # FP8 E4M3 (8 bits) or FP4 E2M1 (4 bits)


@dataclass(frozen=True)
class ActivationScheme:
    bits: int = 8
    granularity: ActGranularity = ActGranularity.TOKEN
    dynamic: bool = True  # False: a calibrated static scale (NVFP4: the global scale; its group scales are dynamic)
    symmetric: bool = True
    type: ActType = ActType.INT
    group_size: int | None = None  # GROUP granularity only

    def __post_init__(self) -> None:
        if not self.symmetric:
            raise ValueError("only symmetric activation quantization is supported")
        if (self.granularity == ActGranularity.GROUP) != (self.group_size is not None):
            raise ValueError("group_size goes with group granularity, and only with it")
        if self.type == ActType.FLOAT:
            self._check_float()
            return
        if not 2 <= self.bits <= 8:
            raise ValueError(f"activation bits must be between 2 and 8, got {self.bits}")
        if self.granularity == ActGranularity.GROUP:
            raise ValueError("int activations are quantized per token or per tensor, not per group")
        if self.granularity == ActGranularity.TOKEN and not self.dynamic:
            raise ValueError("per-token activation scales are dynamic by nature: use dynamic=True")
        if self.granularity == ActGranularity.TENSOR and self.dynamic:
            raise ValueError("dynamic per-tensor activation scales are not supported: use per-token")

    def _check_float(self) -> None:
        if self.bits == 8:
            static = self.granularity == ActGranularity.TENSOR
            if self.dynamic == static:
                raise ValueError("FP8 activations: per-tensor scales are static, per-token and per-group ones dynamic")
        elif self.bits == 4:
            expected = {16: False, 32: True}  # NVFP4: static global scale; MXFP4: all dynamic
            if self.granularity != ActGranularity.GROUP or expected.get(self.group_size) != self.dynamic:
                raise ValueError("FP4 activations are NVFP4 (group 16, static global scale) or MXFP4 (group 32, dynamic)")
        else:
            raise ValueError(f"float activations are FP8 (8 bits) or FP4 (4 bits), got {self.bits}")

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def dynamic_grid(self) -> tuple[float, int]:
        """An int dynamic scale's divisor of the token's absolute maximum, and the lowest code (the highest is
        `qmax`), as the width's consumer computes them: int8 as vLLM's dynamic int8 kernels (127, ``−127``);
        narrower widths as compressed-tensors' symmetric min-max qparams (``(2**bits − 1) / 2``, ``−2**(bits−1)``).
        At 4 bits that step is 7 % finer than ``max / 7``, and a token's maximum still rounds within half a step
        (``7.5 → 8``, saturated to 7)."""
        if self.bits == 8:
            return float(self.qmax), -self.qmax
        return ((1 << self.bits) - 1) / 2, -self.qmax - 1

    def float_grid(self, static: float | None = None) -> FloatScheme:
        """The float grid of the ``[tokens, in]`` view (``static``: NVFP4's calibrated global scale)."""
        if self.bits == 4:
            if self.group_size == 16:
                return FloatScheme(FloatGrid.NVFP4, 16, global_scale=static)
            return FloatScheme(FloatGrid.MXFP4, 32)
        return FloatScheme(FloatGrid.FP8, self.group_size or -1)

    def to_record(self) -> dict:
        record = {"bits": self.bits, "granularity": self.granularity.value, "dynamic": self.dynamic, "symmetric": self.symmetric}
        if self.type != ActType.INT:
            record["type"] = self.type.value
        if self.group_size is not None:
            record["group_size"] = self.group_size
        return record

    @classmethod
    def from_record(cls, record: dict) -> "ActivationScheme":
        group = record.get("group_size")
        return cls(int(record["bits"]), ActGranularity(record["granularity"]), bool(record["dynamic"]), bool(record["symmetric"]),
                   ActType(record.get("type", "int")), None if group is None else int(group))


class ActivationPreset(str, enum.Enum):
    """The activation quantizations a weight quantizer can record (the second half of W8A8, W4A4, ...)."""

    INT8_TOKEN = "int8-token"
    INT8_TENSOR = "int8-tensor"
    INT4_TOKEN = "int4-token"  # W4A4 with integer weights (QuaRot's setting); simulated, not packed
    FP8_TOKEN = "fp8-token"
    FP8_TENSOR = "fp8-tensor"
    FP8_GROUP = "fp8-group"  # 128 columns per scale: FP8 block checkpoints' activations
    NVFP4 = "nvfp4"
    MXFP4 = "mxfp4"

    def scheme(self) -> ActivationScheme:
        token, tensor, group = ActGranularity.TOKEN, ActGranularity.TENSOR, ActGranularity.GROUP
        return {
            ActivationPreset.INT8_TOKEN: ActivationScheme(8, token, True),
            ActivationPreset.INT8_TENSOR: ActivationScheme(8, tensor, False),
            ActivationPreset.INT4_TOKEN: ActivationScheme(4, token, True),
            ActivationPreset.FP8_TOKEN: ActivationScheme(8, token, True, type=ActType.FLOAT),
            ActivationPreset.FP8_TENSOR: ActivationScheme(8, tensor, False, type=ActType.FLOAT),
            ActivationPreset.FP8_GROUP: ActivationScheme(8, group, True, type=ActType.FLOAT, group_size=128),
            ActivationPreset.NVFP4: ActivationScheme(4, group, False, type=ActType.FLOAT, group_size=16),
            ActivationPreset.MXFP4: ActivationScheme(4, group, True, type=ActType.FLOAT, group_size=32),
        }[self]


def static_scale(absmax: torch.Tensor | float, scheme: ActivationScheme) -> torch.Tensor:
    """The static scale for inputs whose calibrated absolute maximum is ``absmax``: per tensor ``absmax / qmax``
    (FP8: ``/ 448``); NVFP4's global scale ``448 · 6 / absmax``."""
    value = torch.as_tensor(absmax, dtype=torch.float32).max()
    if scheme.type == ActType.FLOAT and scheme.bits == 4:
        return torch.tensor(nvfp4_global_scale(value))
    top = FloatFormat.E4M3.max if scheme.type == ActType.FLOAT else scheme.qmax
    return torch.clamp(value / top, min=torch.finfo(torch.float32).tiny)


def _quantize_float(x: torch.Tensor, scheme: ActivationScheme, scale: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).float()
    static = None
    if not scheme.dynamic:
        if scale is None:
            raise ValueError("static activation quantization needs the calibrated input scale")
        static = float(scale.reshape(-1)[0])
    grid = scheme.float_grid(static if scheme.bits == 4 else None)
    if scheme.granularity == ActGranularity.TENSOR:
        s = torch.full((rows.shape[0], 1), static, dtype=torch.float32, device=rows.device)
        z = torch.zeros_like(s)
    else:
        s, z = grid.qparams(rows)
    return grid.dequantize(grid.quantize(rows, s, z), s, z).reshape(x.shape).to(x.dtype)


def quantize_activations(x: torch.Tensor, scheme: ActivationScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize ``x [..., in]``: round to the grid and scale back, in ``x``'s dtype."""
    if scheme.type == ActType.FLOAT:
        return _quantize_float(x, scheme, scale)
    xf = x.float()
    if scheme.dynamic:
        levels, low = scheme.dynamic_grid()
        s = divide(xf.abs().amax(dim=-1, keepdim=True), levels)  # the same quotient on every device
        s = torch.where(s > 0, s, torch.ones_like(s))
    else:
        if scale is None:
            raise ValueError("static activation quantization needs the calibrated input_scale")
        s = scale.to(device=x.device, dtype=torch.float32)
        low = -scheme.qmax - 1  # static: the int8 type's own range saturates
    q = torch.clamp(torch.round(xf / s), low, scheme.qmax)
    return (q * s).to(x.dtype)
