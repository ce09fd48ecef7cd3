"""Quantization schemes by the names users know from llm-compressor: each expands to a weight quantizer's
settings (`GridQuantConfig`: grid, group size, block rows, activations), given beside ``method`` in a recipe
stage (``scheme: nvfp4``) or as ``compress quantize --scheme nvfp4``. Settings given explicitly override the
scheme's and are then validated as usual (NVFP4 with another group size than 16 is an error)."""

from __future__ import annotations

import enum
from typing import Any

from compress.errors import CompressError


class SchemeName(str, enum.Enum):
    FP8_DYNAMIC = "fp8-dynamic"  # FP8 per-channel weights, FP8 per-token dynamic activations
    FP8_BLOCK = "fp8-block"  # FP8 128x128 block weights, FP8 per-128-column dynamic activations (DeepSeek-V3 style)
    NVFP4 = "nvfp4"  # NVFP4 weights and activations (calibrated global input scale)
    NVFP4A16 = "nvfp4a16"  # NVFP4 weights only
    MXFP4 = "mxfp4"  # MXFP4 weights and dynamic MXFP4 activations
    MXFP4A16 = "mxfp4a16"  # MXFP4 weights only
    W4A16 = "w4a16"  # int4, group auto (128 where it divides), symmetric, weights only
    W8A8_INT8 = "w8a8-int8"  # int8 per-channel weights, int8 per-token dynamic activations


SCHEMES: dict[SchemeName, dict[str, Any]] = {
    SchemeName.FP8_DYNAMIC: {"grid": "fp8", "group_size": -1, "activations": "fp8-token"},
    SchemeName.FP8_BLOCK: {"grid": "fp8", "group_size": 128, "block_rows": 128, "activations": "fp8-group"},
    SchemeName.NVFP4: {"grid": "nvfp4", "group_size": 16, "activations": "nvfp4"},
    SchemeName.NVFP4A16: {"grid": "nvfp4", "group_size": 16},
    SchemeName.MXFP4: {"grid": "mxfp4", "group_size": 32, "activations": "mxfp4"},
    SchemeName.MXFP4A16: {"grid": "mxfp4", "group_size": 32},
    SchemeName.W4A16: {"bits": 4, "group_size": "auto", "symmetric": True},
    SchemeName.W8A8_INT8: {"bits": 8, "group_size": -1, "symmetric": True, "activations": "int8-token"},
}


def expand_scheme(scheme: SchemeName, method: str, settings: dict[str, Any], accepted: set[str]) -> dict[str, Any]:
    """The settings of ``method`` (whose config takes the keys ``accepted``) for ``scheme``, ``settings`` on top."""
    missing = sorted(set(SCHEMES[scheme]) - accepted)
    if missing:
        raise CompressError(f"scheme {scheme.value} needs method rtn, gptq or awq: {method} has no {missing[0]} setting")
    return {**SCHEMES[scheme], **settings}
