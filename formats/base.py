"""What the engine hands an output format, and what a format must provide.

A *packed format* turns each finished layer's `QuantResult` (codes ``[out, in]``, scale/zero
``[out, n_groups]``) into the tensors its published layout stores under ``<layer>.`` and, once the
run is over, writes the ``quantization_config`` entry of config.json that tells a loader what the
tensors mean. The engine never asks a format's name: it calls `reason_not_packable` and `tensors`
for every quantized layer, and the runner calls `check_stage` before the run and `config` after it.

Layers a format cannot hold (pruned only, a GPT-2 Conv1D, a stale QuantResult) stay dense, in the
checkpoint's own dtype, and are listed as unquantized in the config.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from compress.quantizers.result import Grid, QuantResult


class OutputFormat(str, enum.Enum):
    compressed_tensors = "compressed-tensors"
    gptq = "gptq"
    fake = "fake"


@dataclass(frozen=True)
class PackedLayer:
    """How one packed layer was quantized: enough to write the config that describes it."""

    scheme: Grid  # an integer QuantScheme or a float grid's FloatScheme
    activations: dict[str, Any] | None = None  # the stage's record()["activations"] (W8A8), or None
    act_order: bool = False  # columns were processed out of order (the quantizer returned a g_idx)
    dynamic_groups: bool = False  # g_idx is not the identity column // group_size


def has_trivial_g_idx(quant: QuantResult) -> bool:
    """True when the QuantResult's groups are plain consecutive column blocks."""
    if quant.g_idx is None:
        return True
    in_features = quant.codes.shape[1]
    width = quant.scheme.group_width(in_features)
    expected = torch.arange(in_features, device=quant.g_idx.device) // width
    return bool(torch.equal(quant.g_idx.to(torch.int64), expected))


class PackFormat(ABC):
    name: str = ""  # the `compression.format` record of config.json

    def check_stage(self, record: dict[str, Any]) -> None:
        """Raise `CompressError` before any work if a stage's settings (its ``record()``) cannot be stored."""

    def reason_not_packable(self, quant: QuantResult, conv1d: bool, activations: dict | None) -> str | None:
        """Why this layer must be written dense instead (None: it can be packed)."""
        if conv1d:
            return "GPT-2 Conv1D layers are not Linear layers to the loaders of this format"
        return None

    def compute_dtype(self, packed: dict[str, PackedLayer]) -> torch.dtype | None:
        """The dtype this format's loaders compute ``packed`` layers in, where they need one (the output's config.json
        then records it); None where they compute in the checkpoint's own dtype."""
        return None

    @abstractmethod
    def tensors(
        self, quant: QuantResult, dtype: torch.dtype, input_scale: torch.Tensor | None, activations: dict | None
    ) -> dict[str, torch.Tensor]:
        """The tensors stored for one layer, by suffix (``weight_packed``, ``qweight``, ...); ``dtype`` is
        the checkpoint's dtype for the weight, ``activations`` the stage's activation record (W8A8)."""

    @abstractmethod
    def config(self, packed: dict[str, PackedLayer], dense: list[str]) -> dict[str, Any]:
        """config.json's ``quantization_config`` for the packed layers; ``dense`` lists every other Linear."""
