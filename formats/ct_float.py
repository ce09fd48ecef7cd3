"""compressed-tensors float layouts (0.20.1): FP8 ``float-quantized`` and FP4 ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized`` (CT ``compressors/naive_quantized``, ``nvfp4``, ``mxfp4``; vLLM reads the same names).

Per quantized Linear ``<p>`` with weight ``[out, in]`` (element bit patterns and scales: ``quantizers/float_grid``):

``float-quantized`` (FP8 E4M3; ``naive-quantized`` when the layer's activations are not quantized, same tensors):
  - ``<p>.weight``        float8_e4m3fn ``[out, in]`` (our codes are its bytes);
  - ``<p>.weight_scale``  float32 ``[1]`` per tensor, ``[out, 1]`` per channel, ``[out, in/g]`` per group,
    ``[ceil(out/bh), in/bw]`` per ``bh × bw`` block;
  - ``<p>.input_scale``   float32 ``[1]``: static per-tensor FP8 activations only.
``nvfp4-pack-quantized``:
  - ``<p>.weight_packed``       uint8 ``[out, in/2]``: two E2M1 nibbles per byte, column ``2j`` in the low nibble;
  - ``<p>.weight_scale``        float8_e4m3fn ``[out, in/16]``;
  - ``<p>.weight_global_scale`` float32 ``[1]``;
  - ``<p>.input_global_scale``  float32 ``[1]``: NVFP4 activations (W4A4) only.
``mxfp4-pack-quantized``:
  - ``<p>.weight_packed``  uint8 ``[out, in/2]`` as above;
  - ``<p>.weight_scale``   uint8 ``[out, in/32]``: E8M0 biased exponents, scale ``2^(byte − 127)``.

Dequantization (float32; the torch reference of the kernels): ``element · scale``, NVFP4 ``element · (ŝ / g)``
in that order, the order of compressed-tensors' ``dequantize`` and of our grid.
"""

from __future__ import annotations

from typing import Any

import torch

from compress.errors import CompressError
from compress.quantizers.float_grid import E8M0_BIAS, FloatFormat, FloatGrid, FloatScheme, decode, mx_scale

FLOAT_QUANTIZED = "float-quantized"
NAIVE_QUANTIZED = "naive-quantized"
NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
FORMATS = (FLOAT_QUANTIZED, NAIVE_QUANTIZED, NVFP4_PACK_QUANTIZED, MXFP4_PACK_QUANTIZED)
_SCALE_DTYPES = {FloatGrid.NVFP4: "torch.float8_e4m3fn", FloatGrid.MXFP4: "torch.uint8"}


# -- config ------------------------------------------------------------------------------------------
def format_name(scheme: FloatScheme, activations: dict | None) -> str:
    if scheme.grid is FloatGrid.NVFP4:
        return NVFP4_PACK_QUANTIZED
    if scheme.grid is FloatGrid.MXFP4:
        return MXFP4_PACK_QUANTIZED
    return FLOAT_QUANTIZED if activations else NAIVE_QUANTIZED


def _strategy(scheme: FloatScheme) -> str:
    if scheme.grid is FloatGrid.NVFP4:
        return "tensor_group"
    if scheme.block_rows == -1:
        return "tensor"
    if scheme.block_rows > 1:
        return "block"
    return "channel" if scheme.group_size == -1 else "group"


def weight_args(scheme: FloatScheme) -> dict[str, Any]:
    """The layer group's ``weights`` entry: compressed-tensors ``QuantizationArgs`` fields."""
    strategy = _strategy(scheme)
    args = {
        "actorder": None,
        "block_structure": (scheme.block_rows, scheme.group_size) if strategy == "block" else None,  # a list in JSON
        "dynamic": False,
        "group_size": scheme.group_size if strategy in ("group", "tensor_group") else None,
        "num_bits": scheme.bits,
        "strategy": strategy,
        "symmetric": True,
        "type": "float",
    }
    if scheme.grid in _SCALE_DTYPES:
        args["scale_dtype"] = _SCALE_DTYPES[scheme.grid]
    return args


def activation_args(activations: dict[str, Any]) -> dict[str, Any]:
    """``input_activations`` for a float activation record (`ActivationScheme.to_record`)."""
    bits, granularity, group = int(activations["bits"]), activations["granularity"], activations.get("group_size")
    args = {"dynamic": bool(activations["dynamic"]), "group_size": group, "num_bits": bits, "strategy": granularity,
            "symmetric": True, "type": "float"}
    if bits == 4 and group == 16:  # NVFP4: dynamic E4M3 group scales under a calibrated global scale
        args.update(dynamic="local", strategy="tensor_group", observer="static_minmax", scale_dtype=_SCALE_DTYPES[FloatGrid.NVFP4])
    elif bits == 4:
        args["scale_dtype"] = _SCALE_DTYPES[FloatGrid.MXFP4]
    return args


def scheme_from_args(prefix: str, weights: dict[str, Any]) -> FloatScheme:
    """The `FloatScheme` (without NVFP4's global scale, which is a tensor) a ``weights`` entry describes."""
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    try:
        if bits == 4:
            grid = FloatGrid.MXFP4 if weights.get("group_size") == 32 and strategy == "group" else FloatGrid.NVFP4
            return FloatScheme(grid, int(weights["group_size"]))
        if bits == 8:
            if strategy == "block":
                rows, cols = (int(v) for v in weights["block_structure"])
                return FloatScheme(FloatGrid.FP8, cols, rows)
            if strategy in ("tensor", "channel"):
                return FloatScheme(FloatGrid.FP8, -1, -1 if strategy == "tensor" else 1)
            if strategy == "group":
                return FloatScheme(FloatGrid.FP8, int(weights["group_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CompressError(f"{prefix}: float weights {weights} are not a layout we read ({exc}): re-export the checkpoint") from None
    raise CompressError(f"{prefix}: float weights with {bits} bits and strategy {strategy!r} are not supported: FP8 or FP4 (NVFP4, MXFP4) only")


def activation_scheme(args: dict[str, Any]):
    """Our `ActivationScheme` for float ``input_activations`` (NVFP4's ``dynamic: local`` has a static global scale)."""
    from compress.quantizers.activations import ActGranularity, ActivationScheme, ActType

    granularity = {"token": ActGranularity.TOKEN, "tensor": ActGranularity.TENSOR}.get(args["strategy"], ActGranularity.GROUP)
    dynamic = args["dynamic"] is True or args["dynamic"] == "true"
    group = args.get("group_size") if granularity == ActGranularity.GROUP else None
    return ActivationScheme(int(args["num_bits"]), granularity, dynamic, bool(args.get("symmetric", True)), ActType.FLOAT, group)


# -- writing -----------------------------------------------------------------------------------------
def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles ``[out, in]`` (in even) as uint8 ``[out, in/2]``, column ``2j`` in the low nibble."""
    pairs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_fp4`: nibbles as int32 ``[out, 2 · packed columns]``."""
    p = packed.to(torch.int32)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(packed.shape[0], -1)


def stored_scale(scale: torch.Tensor, scheme: FloatScheme) -> torch.Tensor:
    """Our ``[out, n_groups]`` scales as the layout stores them (block rows and tensors collapsed)."""
    if scheme.grid is FloatGrid.NVFP4:
        return scale.to(torch.float8_e4m3fn).contiguous()
    if scheme.grid is FloatGrid.MXFP4:
        exponent = torch.frexp(scale)[1] - 1  # scales are powers of two (2^-127 included: frexp handles subnormals)
        return (exponent + E8M0_BIAS).to(torch.uint8).contiguous()
    if scheme.block_rows == -1:
        return scale[:1, 0].float().contiguous()
    return scale[:: scheme.block_rows].float().contiguous()


def tensors(quant, input_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors of one float-quantized layer (a `QuantResult` on a `FloatScheme`); ``input_scale``: the
    calibrated static input scale (FP8 per tensor) or global scale (NVFP4), if the activations have one."""
    scheme: FloatScheme = quant.scheme
    scale = stored_scale(quant.scale, scheme)
    if scheme.grid is FloatGrid.FP8:
        out = {"weight": quant.codes.to(torch.uint8).view(torch.float8_e4m3fn).contiguous(), "weight_scale": scale}
        if input_scale is not None:
            out["input_scale"] = input_scale.detach().reshape(1).float()
        return out
    out = {"weight_packed": pack_fp4(quant.codes), "weight_scale": scale}
    if scheme.grid is FloatGrid.NVFP4:
        out["weight_global_scale"] = torch.tensor([scheme.global_scale], dtype=torch.float32, device=scale.device)
        if input_scale is not None:
            out["input_global_scale"] = input_scale.detach().reshape(1).float()
    return out


# -- reading -----------------------------------------------------------------------------------------
def expected_tensors(scheme: FloatScheme, out_features: int, in_features: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Suffix -> (dtype, shape) of the weight tensors a layer of this scheme stores."""
    groups = scheme.groups(in_features)
    if scheme.grid is FloatGrid.FP8:
        rows = 1 if scheme.block_rows == -1 else -(-out_features // scheme.block_rows)
        scale_shape = (1,) if scheme.block_rows == -1 else (rows, groups)
        return {"weight": (torch.float8_e4m3fn, (out_features, in_features)), "weight_scale": (torch.float32, scale_shape)}
    expected = {"weight_packed": (torch.uint8, (out_features, in_features // 2))}
    if scheme.grid is FloatGrid.NVFP4:
        expected["weight_scale"] = (torch.float8_e4m3fn, (out_features, groups))
        expected["weight_global_scale"] = (torch.float32, (1,))
    else:
        expected["weight_scale"] = (torch.uint8, (out_features, groups))
    return expected


def validate(prefix: str, stored: dict[str, torch.Tensor], scheme: FloatScheme, out_features: int, in_features: int) -> None:
    """`CompressError` unless the stored tensors have the dtypes and shapes the scheme and the model give."""
    try:
        expected = expected_tensors(scheme, out_features, in_features)
    except ValueError as exc:
        raise CompressError(f"{prefix}: {exc}: the config does not match the model") from None
    for key, (dtype, shape) in expected.items():
        t = stored.get(key)
        if t is None:
            raise CompressError(f"{prefix}.{key} is missing from the checkpoint: the packed file is incomplete; re-export it")
        float_scale = key == "weight_scale" and dtype == torch.float32 and t.dtype.is_floating_point and t.element_size() >= 2
        if t.dtype != dtype and not float_scale:
            raise CompressError(f"{prefix}.{key} has dtype {t.dtype}, expected {dtype}: the file is corrupt; re-export it")
        if tuple(t.shape) != shape:
            raise CompressError(f"{prefix}.{key} has shape {list(t.shape)}, expected {list(shape)}: the file is corrupt; re-export it")


def _expand(scale: torch.Tensor, rows: int, cols: int, out_features: int, in_features: int) -> torch.Tensor:
    return scale.repeat_interleave(rows, 0)[:out_features].repeat_interleave(cols, 1)[:, :in_features]


def dequantize_fp8(stored: dict[str, torch.Tensor], block: tuple[int, int] | None = None) -> torch.Tensor:
    """Float32 ``[out, in]`` of a float-quantized layer; ``block`` the ``[bh, bw]`` of a block layout."""
    weight = stored["weight"].float()
    out_features, in_features = weight.shape
    scale = stored["weight_scale"].float().reshape(-1, stored["weight_scale"].shape[-1])
    if block is not None:
        rows, cols = block
    else:
        rows, cols = out_features // scale.shape[0], in_features // scale.shape[1]
    return weight * _expand(scale, rows, cols, out_features, in_features)


def dequantize_fp4(stored: dict[str, torch.Tensor], grid: FloatGrid) -> torch.Tensor:
    """Float32 ``[out, in]`` of an nvfp4- or mxfp4-pack-quantized layer."""
    values = decode(unpack_fp4(stored["weight_packed"]), FloatFormat.E2M1)
    out_features, in_features = values.shape
    scale = stored["weight_scale"]
    if grid is FloatGrid.NVFP4:
        scale = scale.float() / stored["weight_global_scale"].float()
    else:
        scale = mx_scale(scale.to(torch.int32) - E8M0_BIAS)
    width = in_features // scale.shape[1]
    return (values.reshape(out_features, -1, width) * scale.unsqueeze(-1)).reshape(out_features, in_features)
