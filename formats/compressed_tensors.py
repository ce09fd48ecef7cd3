"""compressed-tensors checkpoints (vllm-project/compressed-tensors 0.20.1, ``quant_method: compressed-tensors``).

Layouts, per quantized Linear ``<p>`` with weight ``[out, in]`` and ``G`` groups along ``in``
(see ../shared/reference/formats.md §3; CT ``compressors/pack_quantized/base.py``, ``naive_quantized/base.py``):

``pack-quantized`` (int weight-only, 1-8 bits):
  - ``<p>.weight_packed``     int32 ``[out, ceil(in·b/32)]``: signed codes ``q ∈ [−2^(b−1), 2^(b−1))`` stored
    as ``q + 2^(b−1)`` (our unsigned codes unchanged) and bit-packed along ``in`` (`packing.pack`);
  - ``<p>.weight_scale``      model dtype ``[out, G]`` (``[out, 1]`` per channel);
  - ``<p>.weight_shape``      int64 ``[2]`` = ``[out, in]``;
  - ``<p>.weight_zero_point`` int32 ``[ceil(out·b/32), G]``, asymmetric only, packed along **dim 0**.
``int-quantized`` (W8A8):
  - ``<p>.weight`` int8 ``[out, in]`` (signed codes), ``<p>.weight_scale`` ``[out, 1]``, and
    ``<p>.input_scale`` ``[1]`` for static per-tensor activation scales.

Float layouts (FP8 ``float-quantized``, ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``): ``ct_float.py``.

Dequantization: ``w = (q − zp) · s``; with our unsigned codes ``c = q + 2^(b−1)`` and zero ``z = zp + 2^(b−1)``
this is ``s · (c − z)``, the grid of ``compress.quantizers.grid``, so codes are stored without re-rounding.
Our symmetric zero ``2^(b−1)`` is CT's ``zp = 0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from compress.errors import CompressError
from compress.formats.base import PackedLayer, PackFormat, has_trivial_g_idx
from compress.formats import ct_float
from compress.formats.packing import pack, packed_length, unpack
from compress.quantizers.float_grid import FloatFormat, FloatScheme
from compress.quantizers.result import QuantResult

PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"
CT_VERSION = "0.20.1"  # the layout version we write (2-, 4- and 8-bit are identical in all versions)


@dataclass(frozen=True)
class CTLayerSpec:
    """What config.json says about one layer: its layout and weight (and activation) arguments."""

    format: str
    bits: int
    symmetric: bool
    group_size: int | None  # None: per channel
    input_activations: dict[str, Any] | None = None
    float_scheme: FloatScheme | None = None  # float formats (ct_float): the weights' grid


# -- writing ---------------------------------------------------------------------------------------
def weight_args(layer: PackedLayer) -> dict[str, Any]:
    s = layer.scheme
    channel = s.group_size == -1
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None if channel else s.group_size,
        "num_bits": s.bits,
        "observer": "minmax",
        "strategy": "channel" if channel else "group",
        "symmetric": s.symmetric,
        "type": "int",
    }


def activation_args(activations: dict[str, Any] | None) -> dict[str, Any] | None:
    if not activations:
        return None
    if activations.get("type") == "float":
        return ct_float.activation_args(activations)
    return {
        "dynamic": bool(activations["dynamic"]),
        "num_bits": int(activations["bits"]),
        "strategy": activations["granularity"],
        "symmetric": bool(activations["symmetric"]),
        "type": "int",
    }


def pack_quantized_tensors(quant: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    bits = quant.scheme.bits
    out_features, in_features = quant.codes.shape
    tensors = {
        "weight_packed": pack(quant.codes, bits, dim=1),
        "weight_scale": quant.scale.to(dtype).contiguous(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if not quant.scheme.symmetric:
        tensors["weight_zero_point"] = pack(quant.zero.round().to(torch.int32), bits, dim=0)
    return tensors


def int_quantized_tensors(quant: QuantResult, dtype: torch.dtype, input_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    signed = quant.codes.to(torch.int32) - quant.zero.round().to(torch.int32)  # per channel: zero is [out, 1]
    tensors = {"weight": signed.to(torch.int8), "weight_scale": quant.scale.to(dtype).contiguous()}
    if input_scale is not None:
        tensors["input_scale"] = input_scale.detach().reshape(1).to(dtype)
    return tensors


class CompressedTensorsFormat(PackFormat):
    name = "compressed-tensors"

    def check_stage(self, record: dict[str, Any]) -> None:
        if record.get("activations") and record.get("bits") is not None and record.get("grid", "int") == "int":
            if record.get("bits") != 8 or record.get("group_size") != -1 or not record.get("symmetric", True):
                raise CompressError(
                    f"{record.get('method')}: W8A8 (int-quantized) needs 8-bit symmetric per-channel weights: "
                    "set bits=8, group_size=-1, symmetric=true"
                )

    def compute_dtype(self, packed: dict[str, PackedLayer]) -> torch.dtype | None:
        # compressed-tensors unpacks FP4 codes to bfloat16 whatever the model's dtype (unpack_fp4_from_uint8's default),
        # so a float32 or float16 model's first product with such a layer fails: FP4 layers are computed in bfloat16
        fp4 = any(isinstance(layer.scheme, FloatScheme) and layer.scheme.grid.element is FloatFormat.E2M1 for layer in packed.values())
        return torch.bfloat16 if fp4 else None

    def reason_not_packable(self, quant, conv1d, activations):
        reason = super().reason_not_packable(quant, conv1d, activations)
        if reason is None and not has_trivial_g_idx(quant):
            reason = "compressed-tensors 0.20 has no per-column group index (actorder='group' was removed)"
        s = quant.scheme
        if isinstance(s, FloatScheme):
            return reason
        if reason is None and activations and (s.bits != 8 or s.group_size != -1 or not s.symmetric):
            reason = "int-quantized (W8A8) stores 8-bit symmetric per-channel weights only"
        return reason

    def tensors(self, quant, dtype, input_scale, activations):
        if isinstance(quant.scheme, FloatScheme):
            return ct_float.tensors(quant, input_scale)
        if activations:
            return int_quantized_tensors(quant, dtype, input_scale)
        return pack_quantized_tensors(quant, dtype)

    def config(self, packed: dict[str, PackedLayer], dense: list[str]) -> dict[str, Any]:
        groups: dict[tuple, list[str]] = {}
        for name, layer in packed.items():
            if isinstance(layer.scheme, FloatScheme):
                fmt, args = ct_float.format_name(layer.scheme, layer.activations), ct_float.weight_args(layer.scheme)
            else:
                fmt, args = INT_QUANTIZED if layer.activations else PACK_QUANTIZED, weight_args(layer)
            key = (fmt, tuple(sorted(args.items(), key=str)), repr(activation_args(layer.activations)))
            groups.setdefault(key, []).append(name)
        config_groups = {}
        formats = set()
        for i, ((fmt, wargs, _), names) in enumerate(groups.items()):
            layer = packed[names[0]]
            formats.add(fmt)
            config_groups[f"group_{i}"] = {
                "format": fmt,
                "input_activations": activation_args(layer.activations),
                "output_activations": None,
                # One group: every Linear not ignored. Several: each group names its layers.
                "targets": ["Linear"] if len(groups) == 1 else names,
                "weights": dict(wargs),
            }
        return {
            "config_groups": config_groups,
            "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "global_compression_ratio": None,
            "ignore": sorted(dense),
            "kv_cache_scheme": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": CT_VERSION,
        }


# -- reading ---------------------------------------------------------------------------------------
def _matches(patterns: list[str], name: str, class_name: str) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p in (name, class_name):
            return True
    return False


def layer_specs(qc: dict[str, Any], linear_names: list[str]) -> dict[str, CTLayerSpec]:
    """The quantized layers among ``linear_names`` and their specs, from a ``quantization_config``."""
    if qc.get("quantization_status") != "compressed":
        raise CompressError("compressed-tensors checkpoint is not marked quantization_status: compressed: it holds no packed weights")
    ignore = list(qc.get("ignore") or [])
    specs = {}
    for name in linear_names:
        if _matches(ignore, name, "Linear"):
            continue
        for group in (qc.get("config_groups") or {}).values():
            if not _matches(list(group.get("targets") or []), name, "Linear"):
                continue
            w = group.get("weights") or {}
            fmt = group.get("format") or qc.get("format")
            if fmt in ct_float.FORMATS and w.get("type") == "float":
                scheme = ct_float.scheme_from_args(name, w)
                specs[name] = CTLayerSpec(fmt, scheme.bits, True, scheme.group_size, group.get("input_activations"), scheme)
                break
            if fmt not in (PACK_QUANTIZED, INT_QUANTIZED) or w.get("type", "int") != "int":
                raise CompressError(
                    f"compressed-tensors format {fmt!r} ({w.get('type')}) is not supported: "
                    f"only {PACK_QUANTIZED} and {INT_QUANTIZED} int weights and {', '.join(ct_float.FORMATS)} float ones are"
                )
            group_size = w.get("group_size") if w.get("strategy") == "group" else None
            specs[name] = CTLayerSpec(fmt, int(w["num_bits"]), bool(w.get("symmetric", True)), group_size, group.get("input_activations"))
            break
    return specs


def _expect(prefix: str, tensors: dict[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = tensors.get(key)
    if t is None:
        raise CompressError(f"{prefix}.{key} is missing from the checkpoint: the packed file is incomplete; re-export it")
    if t.dtype != dtype and not (dtype.is_floating_point and t.dtype.is_floating_point):
        raise CompressError(f"{prefix}.{key} has dtype {t.dtype}, expected {dtype}: the file is corrupt; re-export it")
    if tuple(t.shape) != shape:
        raise CompressError(f"{prefix}.{key} has shape {list(t.shape)}, expected {list(shape)}: the file is corrupt; re-export it")


def validate(prefix: str, tensors: dict[str, torch.Tensor], spec: CTLayerSpec, out_features: int, in_features: int) -> None:
    """Check one layer's stored tensors against the model's shape and the config: `CompressError` if off."""
    if spec.float_scheme is not None:
        return ct_float.validate(prefix, tensors, spec.float_scheme, out_features, in_features)
    groups = 1 if spec.group_size is None else in_features // spec.group_size
    if spec.group_size is not None and (spec.group_size < 1 or in_features % spec.group_size):
        raise CompressError(f"{prefix}: group size {spec.group_size} does not divide in_features {in_features}: the config is corrupt")
    if spec.format == INT_QUANTIZED:
        _expect(prefix, tensors, "weight", torch.int8, (out_features, in_features))
        _expect(prefix, tensors, "weight_scale", torch.float32, (out_features, 1))
        return
    _expect(prefix, tensors, "weight_shape", torch.int64, (2,))
    if tensors["weight_shape"].tolist() != [out_features, in_features]:
        raise CompressError(
            f"{prefix}.weight_shape says {tensors['weight_shape'].tolist()} but the model has [{out_features}, {in_features}]: "
            "the checkpoint does not match config.json"
        )
    _expect(prefix, tensors, "weight_packed", torch.int32, (out_features, packed_length(in_features, spec.bits)))
    _expect(prefix, tensors, "weight_scale", torch.float32, (out_features, groups))
    if not spec.symmetric:
        _expect(prefix, tensors, "weight_zero_point", torch.int32, (packed_length(out_features, spec.bits), groups))


def dequantize_pack_quantized(tensors: dict[str, torch.Tensor], bits: int, symmetric: bool) -> torch.Tensor:
    """Float32 weight ``[out, in]`` of a pack-quantized layer (the torch reference for its kernels)."""
    out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
    codes = unpack(tensors["weight_packed"], bits, in_features, dim=1).float()
    scale = tensors["weight_scale"].float()
    if symmetric:
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        zero = unpack(tensors["weight_zero_point"], bits, out_features, dim=0).float()
    width = in_features // scale.shape[1]
    deq = (codes.view(out_features, -1, width) - zero.unsqueeze(-1)) * scale.unsqueeze(-1)
    return deq.reshape(out_features, in_features)


def dequantize_int_quantized(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Float32 weight ``[out, in]`` of an int-quantized (int8, per channel, symmetric) layer."""
    return tensors["weight"].float() * tensors["weight_scale"].float()
