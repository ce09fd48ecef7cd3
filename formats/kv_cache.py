"""Calibrated KV-cache scales as compressed-tensors and vLLM store them.

compressed-tensors 0.20.1 (``quantization/lifecycle/initialize.py``, ``initialize_attn_qparams``) and
vLLM's loader (``CompressedTensorsKVCacheMethod``; ``maybe_remap_kv_scale_name`` maps
``<attn>.k_scale`` to its ``<attn>.attn.k_scale``):

- ``quantization_config.kv_cache_scheme``: the QuantizationArgs of the cached keys and values:
  ``{"num_bits": 8, "type": "float" | "int", "symmetric": true, "strategy": "tensor" | "attn_head",
  "dynamic": false, ...}``. vLLM serves ``float`` 8-bit (FP8 E4M3) only; an ``int`` scheme is read by
  compressed-tensors (transformers simulates it) but not by vLLM.
- per cache-writing attention module ``<attn>`` (e.g. ``model.layers.0.self_attn``): ``<attn>.k_scale``
  and ``<attn>.v_scale``, in the model's dtype, shaped ``[1]`` per tensor or ``[num_kv_heads, 1, 1]``
  per attention head (vLLM reads them as ``[num_kv_heads]``). The cache stores ``x / scale``.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from compress.errors import CompressError
from compress.quantizers.kv_cache import KVCacheFormat

SCALE_SUFFIXES = ("k_scale", "v_scale")


class KVScaleStrategy(str, enum.Enum):
    tensor = "tensor"  # one scale per attention layer for keys, one for values: every vLLM backend
    head = "head"  # one per KV head (compressed-tensors "attn_head"): vLLM's flash-attention backend

    @property
    def ct_name(self) -> str:
        return "attn_head" if self == KVScaleStrategy.head else "tensor"


_TYPES = {KVCacheFormat.fp8: "float", KVCacheFormat.int8: "int"}


def kv_cache_scheme(fmt: KVCacheFormat, strategy: KVScaleStrategy) -> dict[str, Any]:
    """The ``kv_cache_scheme`` entry of ``quantization_config`` for calibrated ``fmt`` scales."""
    if fmt not in _TYPES:
        raise CompressError(f"a {fmt.value} KV cache has no compressed-tensors scheme: store fp8 (vLLM) or int8 scales")
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": "minmax",
        "strategy": strategy.ct_name,
        "symmetric": True,
        "type": _TYPES[fmt],
    }


def scheme_format(scheme: dict[str, Any]) -> tuple[KVCacheFormat, KVScaleStrategy]:
    """The format and strategy of a checkpoint's ``kv_cache_scheme``; `CompressError` if we cannot simulate it."""
    kind, bits, strategy = scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy", "tensor")
    fmt = next((f for f, t in _TYPES.items() if t == kind), None)
    if fmt is None or bits != 8 or not scheme.get("symmetric", True) or scheme.get("dynamic"):
        raise CompressError(
            f"kv_cache_scheme {kind} {bits}-bit (symmetric {scheme.get('symmetric')}, dynamic {scheme.get('dynamic')}) is not "
            "supported: only static symmetric fp8 (float 8-bit) and int8 schemes are; evaluate with --kv-cache none"
        )
    if strategy not in ("tensor", "attn_head"):
        raise CompressError(f"kv_cache_scheme strategy {strategy!r} is not supported: tensor or attn_head")
    return fmt, KVScaleStrategy.head if strategy == "attn_head" else KVScaleStrategy.tensor


def scale_tensors(
    attention: str, k_scale: torch.Tensor, v_scale: torch.Tensor, strategy: KVScaleStrategy, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``<attention>.k_scale`` / ``.v_scale`` for per-head scales ``[num_kv_heads]`` (per tensor: their max)."""
    out = {}
    for suffix, scale in zip(SCALE_SUFFIXES, (k_scale, v_scale)):
        s = scale.detach().float().reshape(-1)
        s = s.reshape(-1, 1, 1) if strategy == KVScaleStrategy.head else s.amax().reshape(1)
        out[f"{attention}.{suffix}"] = s.to(dtype).contiguous()
    return out


def read_scales(tensors: dict[str, torch.Tensor], attention: str, strategy: KVScaleStrategy, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) of one attention module from its stored tensors, checked against the strategy."""
    expected = (kv_heads, 1, 1) if strategy == KVScaleStrategy.head else (1,)
    found = []
    for suffix in SCALE_SUFFIXES:
        t = tensors.get(f"{attention}.{suffix}")
        if t is None:
            raise CompressError(f"{attention}.{suffix} is missing from the checkpoint: its kv_cache_scheme needs it; re-export it")
        if not t.is_floating_point() or t.numel() != int(torch.tensor(expected).prod()):
            raise CompressError(
                f"{attention}.{suffix} has shape {list(t.shape)} ({t.dtype}), expected {list(expected)} floats for "
                f"strategy {strategy.ct_name}: the checkpoint is corrupt; re-export it"
            )
        if not torch.isfinite(t).all() or (t <= 0).any():
            raise CompressError(f"{attention}.{suffix} holds a non-positive or non-finite scale: the checkpoint is corrupt; re-export it")
        found.append(t.float().reshape(-1))
    return found[0], found[1]
