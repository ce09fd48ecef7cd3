"""A quantized KV cache simulated in any transformers model's attention, so perplexity and KLD show what
a cache format costs before it is deployed (`compress eval ppl --kv-cache`).

Every decoder block's cache-writing attention module (`compress.checkpoints.attention`) gets a tap on
its cache argument: the keys (after RoPE) and values of each forward pass go through
`compress.quantizers.kv_cache.quantize_kv` before the attention reads them, exactly as an engine
writes its cache and reads it back. Every position attends to quantized keys and values, its own
included (llama.cpp stores the batch into the cache before attending; vLLM's decode steps read only
cached entries). A model whose attention never writes through the cache is a `CompressError`.

The setting comes from the user (``--kv-cache FORMAT``, or ``none``) or, by default, from the
checkpoint: an output written with calibrated KV-cache scales (``kv_cache_scheme`` and ``k_scale`` /
``v_scale`` tensors, `compress.formats.kv_cache`) is evaluated with those scales, as its consumer
(compressed-tensors, vLLM) would run it. A format the checkpoint has no scales for uses dynamic scales.
"""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Iterator

import torch
from torch import nn

from compress.checkpoints.attention import model_attention_modules, tap_kv_cache
from compress.errors import CompressError
from compress.formats.kv_cache import KVScaleStrategy, read_scales, scheme_format
from compress.quantizers.kv_cache import FP8Rounding, KVCacheFormat, quantize_kv, require_float8

NONE = "none"  # --kv-cache none: keys and values as the model computes them


@dataclass(frozen=True)
class KVCacheSetting:
    format: KVCacheFormat
    strategy: KVScaleStrategy | None = None  # of the checkpoint's calibrated scales; None: dynamic scales
    scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None  # attention module -> (k_scale, v_scale)
    rounding: FP8Rounding = FP8Rounding.nearest  # toward_zero: what vLLM's CPU attention stores

    def describe(self) -> str:
        if self.scales is not None:
            return f"{self.format.value}, calibrated per-{self.strategy.value} scales from the checkpoint"
        return {
            KVCacheFormat.fp8: "fp8 e4m3, dynamic per-tensor scales",
            KVCacheFormat.int8: "int8, dynamic scale per token and head",
            KVCacheFormat.int4: "int4, dynamic scale per token and head",
            KVCacheFormat.q8_0: "q8_0 (llama.cpp blocks of 32)",
            KVCacheFormat.q4_0: "q4_0 (llama.cpp blocks of 32)",
        }[self.format]


def parse_kv_cache(value: str | None) -> KVCacheFormat | str | None:
    """A ``--kv-cache`` value: a format, ``none``, or None (the checkpoint's own scheme, if any)."""
    if value is None or value == NONE:
        return value
    try:
        return KVCacheFormat(value)
    except ValueError:
        raise CompressError(f"--kv-cache {value!r} is not a KV-cache format: use {', '.join(f.value for f in KVCacheFormat)} or none") from None


def _checkpoint_scheme(path: Path) -> dict | None:
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return None
    qc = json.loads(config.read_text()).get("quantization_config")
    return qc.get("kv_cache_scheme") if isinstance(qc, dict) else None


def _stored_scales(path: Path, names: list[str], strategy: KVScaleStrategy, kv_heads: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from compress.checkpoints.shards import CheckpointReader
    from compress.formats.kv_cache import SCALE_SUFFIXES

    reader = CheckpointReader(path)
    tensors = {f"{n}.{s}": reader.get(f"{n}.{s}") for n in names for s in SCALE_SUFFIXES if f"{n}.{s}" in reader}
    return {name: read_scales(tensors, name, strategy, kv_heads) for name in names}


def _kv_heads(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def resolve_kv_cache(path: Path | None, model: nn.Module, choice: KVCacheFormat | str | None) -> KVCacheSetting | None:
    """The KV cache to simulate for ``model`` loaded from ``path``: ``choice`` (None: the checkpoint's own)."""
    if choice == NONE:
        return None
    scheme = _checkpoint_scheme(path) if path is not None else None
    if choice is None and not scheme:
        return None
    try:
        stored = scheme_format(scheme) if scheme else None
    except CompressError:
        if choice is None:  # the checkpoint's own scheme is what would run: say we cannot
            raise
        stored = None  # another format was asked for: the stored scales do not matter
    fmt = stored[0] if choice is None else KVCacheFormat(choice)
    if fmt == KVCacheFormat.fp8:
        require_float8()
    if stored is None or stored[0] != fmt:
        return KVCacheSetting(fmt)
    names = list(model_attention_modules(model))
    return KVCacheSetting(fmt, stored[1], _stored_scales(path, names, stored[1], _kv_heads(model)))


@contextmanager
def simulate_kv_cache(model: nn.Module, setting: KVCacheSetting) -> Iterator[None]:
    """While open, ``model``'s attention reads its keys and values through ``setting``'s cache format."""
    modules = model_attention_modules(model)
    scales = setting.scales or {}
    missing = [name for name in modules if setting.scales is not None and name not in scales]
    if missing:
        raise CompressError(f"the checkpoint has no KV-cache scales for {missing[0]}: re-export it")

    def transform(name: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_scale, v_scale = scales.get(name, (None, None))
        return quantize_kv(keys, setting.format, k_scale, setting.rounding), quantize_kv(values, setting.format, v_scale, setting.rounding)

    with tap_kv_cache(modules, transform) as taps:

        def check(_model, _args, _output):
            taps.check_used(f"--kv-cache {setting.format.value}")
            taps.reset()

        handle = model.register_forward_hook(check)
        try:
            yield
        finally:
            handle.remove()


def kv_cache_context(setting: KVCacheSetting | None, model: nn.Module) -> ContextManager:
    return simulate_kv_cache(model, setting) if setting is not None else nullcontext()
