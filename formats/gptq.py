"""GPTQ checkpoints, AutoGPTQ / GPTQModel "v1" layout (``quant_method: gptq``, ``checkpoint_format: gptq``).

Per quantized Linear ``<p>`` with weight ``[out, in]``, ``b`` bits, ``G`` groups along ``in``
(../shared/reference/formats.md §1.2; AutoGPTQ ``qlinear_cuda_old.py``, GPTQModel
``nn_modules/qlinear/__init__.py::_register_gptq_buffers``):

- ``<p>.qweight`` int32 ``[in·b/32, out]``: codes ``Q = q.T`` (``[in, out]``) bit-packed along ``in`` (dim 0);
- ``<p>.qzeros``  int32 ``[G, out·b/32]``: zero points **minus one** (``Z − 1``), packed along ``out`` (dim 1);
- ``<p>.scales``  fp16  ``[G, out]``;
- ``<p>.g_idx``   int32 ``[in]``: the group of each input column (``k // group_size`` unless act-order
  with dynamic groups; rows of ``qweight`` always stay in the original column order).

Dequantization: ``W[o, k] = scales[g_idx[k], o] · (Q[k, o] − (Zs[g_idx[k], o] + 1))``.

The v1 zero-minus-one rule: a stored zero point is ``Z − 1``, so ``Z = 0`` (possible with an asymmetric
grid whose group has no negative weight) cannot be stored: it would wrap to ``2^b − 1`` and decode as
``2^b``. `remap_zero_points` moves such groups to ``Z = 1`` exactly (codes + 1) when no code of the group
is the top code, and otherwise saturates those top codes one step lower (logged). Symmetric grids
(``Z = 2^(b−1)``) never hit it; their 4-bit ``qzeros`` words are all ``0x77777777``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from compress.errors import CompressError
from compress.formats.base import PackedLayer, PackFormat
from compress.formats.packing import pack, unpack
from compress.quantizers.result import QuantResult

log = logging.getLogger(__name__)

GPTQ_BITS = (2, 3, 4, 8)  # the widths transformers' GPTQConfig accepts


def remap_zero_points(codes: torch.Tensor, zero: torch.Tensor, max_code: int, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Codes ``[out, in]`` and zeros ``[out, G]`` with every zero point >= 1 (v1 rule); returns them and
    the number of codes that had to saturate (0 when the remap is exact)."""
    bad = zero < 1
    if not bool(bad.any()):
        return codes, zero, 0
    out_features, in_features = codes.shape
    grouped = codes.reshape(out_features, -1, width)
    shift = bad.unsqueeze(-1).to(grouped.dtype)
    shifted = grouped + shift
    saturated = int((shifted > max_code).sum())
    codes = shifted.clamp(max=max_code).reshape(out_features, in_features)
    return codes, torch.where(bad, torch.ones_like(zero), zero), saturated


def gptq_tensors(quant: QuantResult) -> dict[str, torch.Tensor]:
    scheme = quant.scheme
    bits = scheme.bits
    in_features = quant.codes.shape[1]
    width = scheme.group_width(in_features)
    codes, zero = quant.codes.to(torch.int32), quant.zero.round().to(torch.int32)
    codes, zero, saturated = remap_zero_points(codes, zero, scheme.max_code, width)
    if saturated:
        log.warning("gptq v1 cannot store a zero point of 0: %d codes saturated one step lower", saturated)
    g_idx = quant.g_idx if quant.g_idx is not None else torch.arange(in_features) // width
    return {
        "qweight": pack(codes.t(), bits, dim=0),
        "qzeros": pack((zero - 1).t(), bits, dim=1),
        "scales": quant.scale.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


class GPTQFormat(PackFormat):
    name = "gptq"

    def check_stage(self, record: dict[str, Any]) -> None:
        method = record.get("method")
        if record.get("grid", "int") != "int":
            raise CompressError(f"{method}: the gptq format stores integer grids, not {record['grid']}: use --format compressed-tensors")
        if record.get("activations"):
            raise CompressError(f"{method}: the gptq format stores weight-only quantization: use --format compressed-tensors for W8A8")
        bits = record.get("bits")
        if bits is not None and bits not in GPTQ_BITS:
            raise CompressError(f"{method}: the gptq format stores {', '.join(map(str, GPTQ_BITS))} bits, not {bits}: use --format compressed-tensors")

    def reason_not_packable(self, quant, conv1d, activations):
        reason = super().reason_not_packable(quant, conv1d, activations)
        out_features, in_features = quant.codes.shape
        bits = quant.scheme.bits
        if reason is None and bits not in GPTQ_BITS:
            reason = f"gptq stores {GPTQ_BITS} bits, not {bits}"
        if reason is None and (in_features * bits % 32 or out_features * bits % 32):
            reason = f"gptq needs in and out features times {bits} bits to fill whole 32-bit words"
        return reason

    def tensors(self, quant, dtype, input_scale, activations):
        return gptq_tensors(quant)

    def config(self, packed: dict[str, PackedLayer], dense: list[str]) -> dict[str, Any]:
        schemes = {layer.scheme for layer in packed.values()}
        if len(schemes) != 1:
            raise CompressError(
                f"the gptq format has one bits/group_size/sym for the whole model, this run used {len(schemes)}: "
                "use --format compressed-tensors"
            )
        scheme = schemes.pop()
        act_order = any(layer.act_order for layer in packed.values())
        dynamic = any(layer.dynamic_groups for layer in packed.values())
        return {
            "bits": scheme.bits,
            "checkpoint_format": "gptq",
            "desc_act": act_order,
            "format": "gptq",
            "group_size": scheme.group_size,
            "modules_in_block_to_quantize": None,
            "pack_dtype": "int32",
            "quant_method": "gptq",
            "static_groups": act_order and not dynamic,  # act-order with g_idx = k // group_size
            "sym": scheme.symmetric,
            "true_sequential": True,
        }


# -- reading ---------------------------------------------------------------------------------------
def _expect(prefix: str, tensors: dict[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = tensors.get(key)
    if t is None:
        raise CompressError(f"{prefix}.{key} is missing from the checkpoint: the packed file is incomplete; re-export it")
    if (t.dtype != dtype) and not (dtype.is_floating_point and t.dtype.is_floating_point):
        raise CompressError(f"{prefix}.{key} has dtype {t.dtype}, expected {dtype}: the file is corrupt; re-export it")
    if tuple(t.shape) != shape:
        raise CompressError(f"{prefix}.{key} has shape {list(t.shape)}, expected {list(shape)}: the file is corrupt; re-export it")


def validate(prefix: str, tensors: dict[str, torch.Tensor], bits: int, group_size: int, out_features: int, in_features: int) -> None:
    """Check one layer's stored tensors against the model's shape and the config: `CompressError` if off."""
    if bits not in GPTQ_BITS:
        raise CompressError(f"gptq config has bits={bits}: only {GPTQ_BITS} exist in this format")
    if in_features * bits % 32 or out_features * bits % 32:
        raise CompressError(f"{prefix}: [{out_features}, {in_features}] cannot be packed in {bits}-bit gptq words: the checkpoint is corrupt")
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    _expect(prefix, tensors, "qweight", torch.int32, (in_features * bits // 32, out_features))
    _expect(prefix, tensors, "qzeros", torch.int32, (groups, out_features * bits // 32))
    _expect(prefix, tensors, "scales", torch.float16, (groups, out_features))
    if "g_idx" in tensors:
        _expect(prefix, tensors, "g_idx", torch.int32, (in_features,))
        g = tensors["g_idx"]
        if in_features and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise CompressError(f"{prefix}.g_idx points outside its {groups} groups: the file is corrupt; re-export it")


def dequantize(tensors: dict[str, torch.Tensor], bits: int, group_size: int | None = None) -> torch.Tensor:
    """Float32 weight ``[out, in]`` of one GPTQ v1 layer (the torch reference for its kernels).

    Without a ``g_idx`` tensor the groups are consecutive blocks of ``group_size`` columns.
    """
    qweight, scales = tensors["qweight"], tensors["scales"].float()
    in_features, out_features = qweight.shape[0] * 32 // bits, qweight.shape[1]
    q = unpack(qweight, bits, in_features, dim=0).float()  # [in, out]
    zero = unpack(tensors["qzeros"], bits, out_features, dim=1).float() + 1  # [G, out]
    groups = scales.shape[0]
    g_idx = tensors.get("g_idx")
    width = group_size if group_size is not None and group_size > 0 else -(-in_features // groups)
    consecutive = torch.arange(in_features, device=qweight.device) // width
    if g_idx is None or torch.equal(g_idx.long(), consecutive):
        if width * groups == in_features:  # plain blocks of columns: broadcast instead of gathering per column
            deq = (q.view(groups, -1, out_features) - zero.unsqueeze(1)) * scales.unsqueeze(1)
            return deq.reshape(in_features, out_features).t()  # a transposed view: F.linear wants exactly that
        g_idx = consecutive
    g = g_idx.long()
    return ((q - zero[g]) * scales[g]).t()
