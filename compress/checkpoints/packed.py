"""Load packed checkpoints (compressed-tensors, GPTQ v1) into a model whose quantized layers are `QuantLinear`.

The model skeleton is built from config.json on the meta device; every Linear layer the checkpoint
stores packed (per its ``quantization_config``, cross-checked with the tensors present) becomes a
`QuantLinear` holding the packed tensors after they are validated against the layer's shape; every
other parameter is read as usual. A tampered or truncated file is a `CompressError`, never garbage.

`packed_summary` reports, from the tensor headers alone, the recognized format and the bits each
weight of the linear layers takes on disk (codes plus scales, zero points and indices).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.formats import ct_float
from compress.formats import gptq
from compress.kernels.quant_linear import QuantLinear
from compress.quantizers.float_grid import FloatGrid
from compress.checkpoints.model_io import ModelHandle, install_transforms, open_model, quantizable_layers

log = logging.getLogger(__name__)

CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight", "input_scale", "input_zero_point",
               "weight_global_scale", "input_global_scale")
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def detect_format(config: dict[str, Any]) -> str | None:
    """``"compressed-tensors"``, ``"gptq"`` or None (dense) from a config.json dict."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method in ("compressed-tensors", "gptq"):
        return method
    raise CompressError(f"quantization_config.quant_method {method!r} is not supported: only compressed-tensors and gptq checkpoints load")


def _linear_names(handle: ModelHandle) -> dict[str, nn.Module]:
    block_names = [handle.block_name(i) for i in range(len(handle.blocks))]
    return {n: m for n, m in quantizable_layers(handle.model, block_names, include=[".*"]).items() if isinstance(m, nn.Linear)}


def _key(handle: ModelHandle, name: str) -> str | None:
    try:
        return handle.checkpoint_key(name)
    except CompressError:
        return None


def _read(handle: ModelHandle, prefix: str, suffixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    found = {}
    for suffix in suffixes:
        key = _key(handle, f"{prefix}.{suffix}")
        if key is not None:
            found[suffix] = handle.reader.get(key)
    return found


def _ct_layers(handle: ModelHandle, qc: dict, linears: dict[str, nn.Module]) -> Iterator[tuple[str, QuantLinear]]:
    specs = ct.layer_specs(qc, list(linears))
    for name, module in linears.items():
        spec = specs.get(name)
        if spec is None:
            if _key(handle, f"{name}.weight_packed") is not None:
                raise CompressError(f"{name} is stored packed but config.json's quantization_config does not quantize it: the config is corrupt")
            continue
        tensors = _read(handle, name, CT_SUFFIXES)
        ct.validate(name, tensors, spec, module.out_features, module.in_features)
        activations = None
        if spec.float_scheme is not None:  # FP8 / NVFP4 / MXFP4 (formats/ct_float.py)
            dequantize, activations = _float_layer(name, spec, tensors)
        elif spec.format == ct.INT_QUANTIZED:
            tensors = {k: tensors[k] for k in ("weight", "weight_scale", "input_scale") if k in tensors}
            dequantize = ct.dequantize_int_quantized
            activations = _activation_scheme(name, spec.input_activations, tensors)
        else:
            tensors = {k: v for k, v in tensors.items() if k.startswith("weight_")}
            dequantize = functools.partial(ct.dequantize_pack_quantized, bits=spec.bits, symmetric=spec.symmetric)
        yield name, QuantLinear(
            module.in_features, module.out_features, tensors, dequantize, _bias(handle, name, module), activations, spec.format
        )


def _float_layer(name: str, spec, tensors: dict[str, torch.Tensor]):
    """The dequantizer and activation scheme of a float-quantized layer (``tensors`` as stored)."""
    scheme = spec.float_scheme
    if scheme.grid is FloatGrid.FP8:
        block = (scheme.block_rows, scheme.group_size) if scheme.block_rows > 1 else None
        dequantize = functools.partial(ct_float.dequantize_fp8, block=block)
    else:
        dequantize = functools.partial(ct_float.dequantize_fp4, grid=scheme.grid)
    args = spec.input_activations
    if not args:
        return dequantize, None
    try:
        activations = ct_float.activation_scheme(args)
    except (KeyError, TypeError, ValueError) as exc:
        raise CompressError(f"{name}: input_activations {args} are not supported ({exc}): re-export the checkpoint") from None
    static = "input_global_scale" if activations.bits == 4 else "input_scale"
    if not activations.dynamic and static not in tensors:
        raise CompressError(f"{name}.{static} is missing: static activation quantization needs it; re-export the checkpoint")
    return dequantize, activations


def _activation_scheme(name: str, args: dict | None, tensors: dict[str, torch.Tensor]):
    if not args:
        return None
    from compress.quantizers.activations import ActGranularity, ActivationScheme

    try:
        scheme = ActivationScheme(int(args["num_bits"]), ActGranularity(args["strategy"]), bool(args["dynamic"]), bool(args["symmetric"]))
    except (KeyError, ValueError) as exc:
        raise CompressError(f"{name}: input_activations {args} are not supported ({exc}): re-export the checkpoint") from None
    if not scheme.dynamic and "input_scale" not in tensors:
        raise CompressError(f"{name}.input_scale is missing: static activation quantization needs it; re-export the checkpoint")
    return scheme


def _gptq_layers(handle: ModelHandle, qc: dict, linears: dict[str, nn.Module]) -> Iterator[tuple[str, QuantLinear]]:
    try:
        bits, group_size = int(qc["bits"]), int(qc.get("group_size", -1))
    except (KeyError, TypeError, ValueError):
        raise CompressError("gptq quantization_config has no valid bits/group_size: the config is corrupt") from None
    built = 0
    for name, module in linears.items():
        tensors = _read(handle, name, GPTQ_SUFFIXES)
        if not tensors:
            continue
        gptq.validate(name, tensors, bits, group_size, module.out_features, module.in_features)
        dequantize = functools.partial(gptq.dequantize, bits=bits, group_size=group_size)
        built += 1
        yield name, QuantLinear(module.in_features, module.out_features, tensors, dequantize, _bias(handle, name, module), layout="gptq")
    if not built:
        raise CompressError("gptq checkpoint holds no qweight tensors: the file is incomplete; re-export it")


def _quantization_config(handle: ModelHandle) -> dict:
    qc = handle.config.quantization_config
    return qc if isinstance(qc, dict) else qc.to_dict()


def iter_packed_layers(handle: ModelHandle) -> Iterator[tuple[str, QuantLinear]]:
    """Each layer the checkpoint stores packed, as a `QuantLinear` validated against the model's shapes,
    one at a time (name, layer)."""
    qc = _quantization_config(handle)
    linears = _linear_names(handle)
    kind = detect_format({"quantization_config": qc})
    yield from (_ct_layers if kind == "compressed-tensors" else _gptq_layers)(handle, qc, linears)


def _bias(handle: ModelHandle, name: str, module: nn.Linear) -> torch.Tensor | None:
    if module.bias is None:
        return None
    key = _key(handle, f"{name}.bias")
    if key is None:
        raise CompressError(f"{name}.bias is missing from the checkpoint: the file is incomplete; re-export it")
    return handle.reader.get(key).float()


def load_packed_model(path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """The checkpoint at ``path`` as an eval-mode model with `QuantLinear` layers, on ``device``."""
    handle = open_model(path, trust_remote_code)
    built = dict(iter_packed_layers(handle))
    kind = detect_format({"quantization_config": _quantization_config(handle)})
    model = handle.model
    for name, layer in built.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    install_transforms(handle)  # the packed layers that replaced hooked ones
    model = handle.load_remaining(device, dtype)
    log.info("loaded %d packed layers (%s) from %s", len(built), kind, path)
    return model


# -- inspection --------------------------------------------------------------------------------------
def _stored_bytes(handle: ModelHandle, key: str) -> int:
    entry = getattr(handle.reader, "_entries", {}).get(key)
    if entry is not None:  # safetensors: from the header, nothing read
        begin, end = entry[1]["data_offsets"]
        return end - begin
    t = handle.reader.get(key)
    return t.numel() * t.element_size()


def packed_summary(handle: ModelHandle, config: dict[str, Any], layers: dict[str, nn.Module]) -> dict[str, Any]:
    """Recognized format and on-disk bits per weight of ``layers`` (weights, scales, zeros, indices)."""
    kind = detect_format(config)
    qc = config.get("quantization_config") or {}
    label = "dense"
    if kind == "compressed-tensors":
        label = f"compressed-tensors ({qc.get('format', '?')})"
    elif kind == "gptq":
        label = f"gptq ({qc.get('checkpoint_format', 'gptq')}, {qc.get('bits')}-bit, group {qc.get('group_size')})"
    total_bits = weights = packed = 0
    packed_bits = packed_weights = 0
    for name, module in layers.items():
        keys = [k for s in ("weight", *CT_SUFFIXES, *GPTQ_SUFFIXES) if (k := _key(handle, f"{name}.{s}")) is not None]
        size = sum(_stored_bytes(handle, k) for k in set(keys)) * 8
        count = module.weight.numel()
        total_bits, weights = total_bits + size, weights + count
        if any(k.endswith((".weight_packed", ".qweight")) or (k.endswith(".weight") and _is_int(handle, k)) for k in keys):
            packed += 1
            packed_bits, packed_weights = packed_bits + size, packed_weights + count
    return {
        "format": label,
        "packed_layers": packed,
        "bits_per_weight": total_bits / weights if weights else None,
        "packed_bits_per_weight": packed_bits / packed_weights if packed_weights else None,
    }


def _is_int(handle: ModelHandle, key: str) -> bool:
    """The stored ``.weight`` holds codes (int8/int32, or FP8 elements), not a dense float weight."""
    entry = getattr(handle.reader, "_entries", {}).get(key)
    return entry is not None and entry[1]["dtype"] in ("I8", "I32", "F8_E4M3")
