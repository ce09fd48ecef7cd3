"""One strided view of every int group-quantized layout we store, for the kernels.

Both packed layouts (``formats/compressed_tensors.py`` pack-quantized, ``formats/gptq.py`` v1) hold the same
thing: codes ``c[n, k]`` of ``b`` bits packed along ``k`` (in), per-group scales ``s[g, n]`` and (optional)
zero codes ``z[g, n]`` packed along ``n`` (out); they differ only in which axis is contiguous, in GPTQ's
stored zero being ``Z − 1`` and in GPTQ's per-column group index. `GroupPacked` records pointers and
strides so one kernel reads both:

    word(n, k)  = words[(k // (32/b)) · word_strides[0] + n · word_strides[1]]
    c[n, k]     = (word >> (k mod (32/b)) · b) & (2^b − 1)
    g(k)        = g_idx[k] if g_idx is not None else k // group_width
    z[g, n]     = code of zeros[g · zero_strides[0] + (n // (32/b)) · zero_strides[1]] + zero_offset
                  (2^(b−1) when zeros is None: the symmetric grid)
    W[n, k]     = (c[n, k] − z[g, n]) · s[g(k), n]        (float32, the references' exact operation order)

Shapes: ``W`` is ``[out_features, in_features]`` = ``[N, K]``. Only ``b`` in {2, 4, 8} (codes never straddle a
word); `describe_*` return None for other widths and the caller keeps the torch reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from compress.quantizers.float_grid import FloatGrid

KERNEL_BITS = (2, 4, 8)


@dataclass(frozen=True)
class GroupPacked:
    words: torch.Tensor  # int32
    word_strides: tuple[int, int]  # (per word along K, per n)
    scales: torch.Tensor  # float (any float dtype; read as float32)
    scale_strides: tuple[int, int]  # (per group, per n)
    zeros: torch.Tensor | None  # int32, packed along N; None: symmetric (zero 2^(b-1))
    zero_strides: tuple[int, int]  # (per group, per word along N)
    zero_offset: int  # added to the stored zero code (GPTQ v1 stores Z - 1)
    g_idx: torch.Tensor | None  # int32 [K]; None: consecutive groups of group_width columns
    group_width: int
    bits: int
    out_features: int
    in_features: int

    @property
    def device(self) -> torch.device:
        return self.words.device


def _strides(t: torch.Tensor, k_dim: int) -> tuple[int, int]:
    return t.stride(k_dim), t.stride(1 - k_dim)


def describe_pack_quantized(tensors: dict[str, torch.Tensor], bits: int, symmetric: bool) -> GroupPacked | None:
    """compressed-tensors pack-quantized: ``weight_packed [N, Kw]``, ``weight_scale [N, G]``, zero ``[Nw, G]``."""
    if bits not in KERNEL_BITS:
        return None
    out_features, in_features = (int(v) for v in tensors["weight_shape"].tolist())
    words, scales = tensors["weight_packed"], tensors["weight_scale"]
    zeros = None if symmetric else tensors["weight_zero_point"]
    return GroupPacked(
        words=words, word_strides=_strides(words, 1),
        scales=scales, scale_strides=_strides(scales, 1),
        zeros=zeros, zero_strides=(0, 0) if zeros is None else _strides(zeros, 1), zero_offset=0,
        g_idx=None, group_width=in_features // scales.shape[1],
        bits=bits, out_features=out_features, in_features=in_features,
    )


def describe_gptq(tensors: dict[str, torch.Tensor], bits: int, group_size: int | None = None) -> GroupPacked | None:
    """GPTQ v1: ``qweight [Kw, N]``, ``scales [G, N]``, ``qzeros [G, Nw]`` (Z − 1), ``g_idx [K]``."""
    if bits not in KERNEL_BITS:
        return None
    words, scales, zeros = tensors["qweight"], tensors["scales"], tensors["qzeros"]
    in_features, out_features = words.shape[0] * 32 // bits, words.shape[1]
    groups = scales.shape[0]
    # the reference's group width: the config's group size, else as many columns as fill the stored groups
    width = group_size if group_size is not None and group_size > 0 else -(-in_features // groups)
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        consecutive = torch.arange(in_features, device=g_idx.device) // width
        g_idx = None if torch.equal(g_idx.long(), consecutive) else g_idx.to(torch.int32).contiguous()
    return GroupPacked(
        words=words, word_strides=_strides(words, 0),
        scales=scales, scale_strides=_strides(scales, 0),
        zeros=zeros, zero_strides=_strides(zeros, 0), zero_offset=1,
        g_idx=g_idx, group_width=width,
        bits=bits, out_features=out_features, in_features=in_features,
    )


@dataclass(frozen=True)
class FloatPacked:
    """A float-quantized weight (``formats/ct_float.py``) for ``kernels/triton_float.py``: FP8 bytes ``[N, K]``
    with float32 scales per ``row_block × col_block`` tile, or FP4 nibbles ``[N, K/2]`` with E4M3 (NVFP4, and
    its float32 ``global_scale``) or E8M0 (MXFP4) scale bytes ``[N, K/col_block]``."""

    grid: FloatGrid
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    row_block: int
    col_block: int
    out_features: int
    in_features: int

    @property
    def device(self) -> torch.device:
        return self.codes.device


def describe_float(tensors: dict[str, torch.Tensor], grid: FloatGrid, block: tuple[int, int] | None = None) -> FloatPacked:
    """The `FloatPacked` view of a float layout's tensors (``block``: an FP8 block layout's ``[bh, bw]``)."""
    scales = tensors["weight_scale"]
    if grid is FloatGrid.FP8:
        codes = tensors["weight"]
        out_features, in_features = codes.shape
        rows, cols = scales.reshape(-1, scales.shape[-1]).shape
        row_block, col_block = block if block is not None else (out_features // rows, in_features // cols)
        return FloatPacked(grid, codes, scales, None, row_block, col_block, out_features, in_features)
    codes = tensors["weight_packed"]
    out_features, in_features = codes.shape[0], codes.shape[1] * 2
    return FloatPacked(grid, codes, scales, tensors.get("weight_global_scale"), 1, in_features // scales.shape[1],
                       out_features, in_features)


def describe_layer(layer) -> GroupPacked | FloatPacked | None:
    """The `GroupPacked` (or `FloatPacked`) view of a `QuantLinear`'s buffers, or None when no kernel covers
    it (W8A8 and other activation-quantizing layers, 3-bit, an unknown dequantizer): those keep the torch reference."""
    from compress.formats import compressed_tensors as ct
    from compress.formats import ct_float
    from compress.formats import gptq

    deq = layer._dequantize
    if layer.activations is not None or not isinstance(deq, functools.partial):
        return None
    tensors, kw = layer.packed_tensors(), deq.keywords
    if deq.func is ct_float.dequantize_fp8:
        return describe_float(tensors, FloatGrid.FP8, kw.get("block"))
    if deq.func is ct_float.dequantize_fp4:
        return describe_float(tensors, kw["grid"])
    if deq.func is ct.dequantize_pack_quantized:
        return describe_pack_quantized(tensors, kw["bits"], kw["symmetric"])
    if deq.func is gptq.dequantize:
        return describe_gptq(tensors, kw["bits"], kw.get("group_size"))
    return None
