"""A recipe's ``kv_cache`` section in a compression run: calibrate the scales on the engine's block runs,
store them beside the weights, and describe them in ``quantization_config.kv_cache_scheme``."""

from __future__ import annotations

from typing import Any

import torch

from compress.checkpoints.loading import model_dtype
from compress.checkpoints.shards import ShardedWriter
from compress.engine.kv_calibration import KVCacheCalibration
from compress.formats.compressed_tensors import CT_VERSION
from compress.run.recipe import Recipe


def kv_observer(recipe: Recipe) -> KVCacheCalibration | None:
    """The engine observer that collects the KV statistics, if the recipe asks for calibrated scales."""
    return KVCacheCalibration(recipe.kv_cache) if recipe.kv_cache is not None else None


def store_kv_scales(observer: KVCacheCalibration | None, writer: ShardedWriter, config) -> dict[str, Any] | None:
    """Write the ``k_scale``/``v_scale`` tensors; returns the ``kv_cache_scheme`` (None without an observer)."""
    if observer is None:
        return None
    for name, tensor in observer.tensors(model_dtype(config)).items():
        writer.add(name, tensor)
    return observer.spec.scheme()


def with_kv_cache_scheme(quantization_config: dict[str, Any] | None, scheme: dict[str, Any] | None, dense: list[str]) -> dict[str, Any] | None:
    """``quantization_config`` with ``kv_cache_scheme`` set; a weight-less compressed-tensors config (every
    Linear dense) when no layer was stored packed."""
    if scheme is None:
        return quantization_config
    if quantization_config is None:
        quantization_config = {
            "config_groups": {},
            "format": "dense",
            "global_compression_ratio": None,
            "ignore": sorted(dense),
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": CT_VERSION,
        }
    return {**quantization_config, "kv_cache_scheme": scheme}
