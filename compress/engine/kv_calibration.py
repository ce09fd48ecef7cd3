"""Calibrated KV-cache scales: the largest key and value each attention layer writes to its cache.

The engine runs every compressed block on the calibration inputs to produce the next block's inputs;
`KVCacheCalibration.watch` taps that run (`compress.checkpoints.attention`): for each cache-writing
attention module it keeps the running ``max |k|`` and ``max |v|`` per KV head over all calibration
tokens (keys after RoPE, as the cache stores them), float32. So the scales belong to the compressed
model the output holds, seeing the compressed model's own activations.

`scales` turns them into static scales (`compress.quantizers.kv_cache.scale_from_amax`: amax / 448 for
FP8 E4M3, / 127.5 for int8) and `tensors` into the ``k_scale`` / ``v_scale`` tensors compressed-tensors
and vLLM read (`compress.formats.kv_cache`), per tensor (the max over heads) or per KV head.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from compress.checkpoints.attention import cache_attention_modules, no_hook_reason, tap_kv_cache
from compress.errors import CompressError
from compress.formats.kv_cache import KVScaleStrategy, kv_cache_scheme, scale_tensors
from compress.quantizers.kv_cache import KVCacheFormat, require_float8, scale_from_amax


class KVCacheSpec(BaseModel):
    """A recipe's ``kv_cache`` section: calibrate and store static KV-cache scales."""

    model_config = ConfigDict(extra="forbid")
    format: KVCacheFormat = Field(description="fp8 (FP8 E4M3, served by vLLM) or int8 (compressed-tensors)")
    strategy: KVScaleStrategy = Field(KVScaleStrategy.tensor, description="tensor (every vLLM backend) or head (per KV head)")

    @field_validator("format")
    @classmethod
    def _calibrated(cls, fmt: KVCacheFormat) -> KVCacheFormat:
        if not fmt.calibrated:
            raise ValueError(
                f"{fmt.value} has no calibrated scale to store: use fp8 or int8 ({fmt.value} is evaluation-only: compress eval ppl --kv-cache)"
            )
        if fmt == KVCacheFormat.fp8:
            require_float8()
        return fmt

    def scheme(self) -> dict[str, Any]:
        return kv_cache_scheme(self.format, self.strategy)


class KVCacheCalibration:
    """Running per-head absolute maxima of every tapped attention module's keys and values."""

    name = "KV-cache calibration"
    learned_state = ("amax",)  # kept over the blocks; a resumed run restores it (engine/journal.py)

    def __init__(self, spec: KVCacheSpec):
        self.spec = spec
        self.amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # attention -> (k [kv_heads], v [kv_heads])

    def _record(self, name: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        observed = tuple(t.detach().abs().amax(dim=(0, 2, 3)).float().cpu() for t in (keys, values))
        earlier = self.amax.get(name)
        self.amax[name] = observed if earlier is None else tuple(torch.maximum(a, b) for a, b in zip(earlier, observed))
        return keys, values

    @contextmanager
    def watch(self, block_name: str, block: nn.Module) -> Iterator[None]:
        """Record the keys and values ``block`` writes while open (one run over the calibration inputs)."""
        modules = cache_attention_modules(block, block_name)
        if not modules:
            raise CompressError(f"{block_name}: {no_hook_reason()}")
        with tap_kv_cache(modules, self._record) as taps:
            yield
        taps.check_used(f"kv_cache {self.spec.format.value}")

    def combine(self, ranks) -> None:
        """The maxima over every rank's calibration tokens (`compress.engine.ranks.Ranks`)."""
        for pair in self.amax.values():
            for amax in pair:
                ranks.max_(amax)

    def scales(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Static per-head scales (k, v) ``[kv_heads]`` float32 per attention module."""
        return {name: (scale_from_amax(k, self.spec.format), scale_from_amax(v, self.spec.format)) for name, (k, v) in self.amax.items()}

    def tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The ``<attention>.k_scale`` / ``.v_scale`` tensors to store, in the model's ``dtype``."""
        out: dict[str, torch.Tensor] = {}
        for name, (k, v) in self.scales().items():
            out.update(scale_tensors(name, k, v, self.spec.strategy, dtype))
        return out

    def record(self) -> dict[str, Any]:
        """What config.json's ``compression`` record says about the KV cache."""
        return {"format": self.spec.format.value, "strategy": self.spec.strategy.value, "layers": len(self.amax)}
