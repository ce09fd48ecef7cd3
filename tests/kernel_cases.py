"""Random layers in every kernel layout, with their torch reference dequantizers: the cases the kernel tests
share (the interpreter tests on CPU, tests/kernels/test_on_cuda.py on a GPU)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from references import random_weight
from compress.formats import compressed_tensors as ct
from compress.formats import ct_float
from compress.formats import gptq
from compress.kernels.layouts import describe_float, describe_gptq, describe_pack_quantized
from compress.quantizers.float_grid import FloatGrid, FloatScheme
from compress.quantizers.grid import QuantScheme
from compress.quantizers.rtn import rtn


def int_layer(layout: str, bits: int, symmetric: bool, group_size: int, shape, seed: int = 0, act_order: bool = False):
    """(tensors, reference dequantizer, descriptor) of a random weight in ``layout``."""
    quant = rtn(random_weight(shape, seed=seed), QuantScheme(bits, symmetric, group_size))
    if layout == "gptq":
        if act_order:  # a permuted column -> group map, as act-order checkpoints store
            width = shape[1] if group_size == -1 else group_size
            g = torch.arange(shape[1]) // width
            quant = dataclasses.replace(quant, g_idx=g[torch.randperm(shape[1], generator=torch.Generator().manual_seed(seed))])
        tensors = gptq.gptq_tensors(quant)
        return tensors, functools.partial(gptq.dequantize, bits=bits, group_size=group_size), describe_gptq(tensors, bits, group_size)
    tensors = ct.pack_quantized_tensors(quant, torch.bfloat16)
    return tensors, functools.partial(ct.dequantize_pack_quantized, bits=bits, symmetric=symmetric), describe_pack_quantized(tensors, bits, symmetric)


# odd shapes: rows not a multiple of the tile, a single group, K not a multiple of BLOCK_K (64)
CT_CASES = [(4, True, 16, (37, 80)), (4, False, 16, (40, 80)), (8, True, -1, (5, 36)), (8, False, 12, (8, 36)),
            (2, False, -1, (33, 96)), (4, True, -1, (3, 200))]
GPTQ_CASES = [(4, True, 32, (32, 96)), (4, False, 16, (40, 80)), (8, False, -1, (8, 36)), (2, True, 64, (48, 128))]


FLOAT_CASES = {  # name: (scheme, shape)
    "fp8-block": (FloatScheme(FloatGrid.FP8, 32, 16), (37, 96)),  # 37 rows: a 5-row last block
    "fp8-block-128": (FloatScheme(FloatGrid.FP8, 128, 128), (130, 128)),
    "fp8-channel": (FloatScheme(FloatGrid.FP8, -1), (5, 36)),
    "fp8-tensor": (FloatScheme(FloatGrid.FP8, -1, -1), (9, 80)),
    "nvfp4": (FloatScheme(FloatGrid.NVFP4, 16), (37, 80)),
    "mxfp4": (FloatScheme(FloatGrid.MXFP4, 32), (20, 96)),
}


def float_layer(name: str, seed: int = 0):
    """(tensors, reference dequantizer, descriptor) of a random weight in the named layout."""
    scheme, shape = FLOAT_CASES[name]
    w = random_weight(shape, seed) * 0.05
    w[0, : min(32, shape[1])] = 0.0  # an all-zero group (MXFP4: the subnormal scale byte 0)
    quant = rtn(w, scheme)
    tensors = ct_float.tensors(quant)
    if scheme.grid is FloatGrid.FP8:
        block = (scheme.block_rows, scheme.group_size) if scheme.block_rows > 1 else None
        reference = lambda t: ct_float.dequantize_fp8(t, block)  # noqa: E731
        return tensors, reference, describe_float(tensors, FloatGrid.FP8, block)
    return tensors, lambda t: ct_float.dequantize_fp4(t, scheme.grid), describe_float(tensors, scheme.grid)


# where each block's float16 factors live: random bytes there could be NaN/inf, so they are overwritten
F16_OFFSETS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,)}


def random_blocks(block, n_blocks: int, seed: int) -> np.ndarray:
    """A `GGUFBlock`'s ``n_blocks`` blocks: every byte random (all code, scale and min bit patterns), the f16 factors finite and varied."""
    rng = np.random.default_rng(seed)
    size = block.size
    data = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_OFFSETS[block.name]:
        factors = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-4, 2, n_blocks)).astype(np.float16)
        data[:, off:off + 2] = factors.view(np.uint8).reshape(n_blocks, 2)
    return data
