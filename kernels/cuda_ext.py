"""The CUDA C++ int group dequant (csrc/int_dequant.cu + csrc/binding.cpp), built on first use.

``torch.utils.cpp_extension.load`` compiles it for the local GPU into torch's extension cache the first
time `dequantize` runs (about a minute; later runs reuse the build). `dequantize(desc) -> float32 [N, K]`
performs the reference's operations in the same order (layouts.py), so it equals the Triton kernel and
the torch reference bit for bit. Without CUDA, `available()` is False and nothing is compiled.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from compress.errors import CompressError
from compress.kernels.layouts import GroupPacked

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "binding.cpp", CSRC / "int_dequant.cu")


def available() -> bool:
    return torch.cuda.is_available() and torch.version.cuda is not None


@functools.cache
def _extension():
    if not available():
        raise CompressError("the CUDA dequant kernel needs a CUDA build of torch and a GPU: use the Triton or torch path")
    from torch.utils.cpp_extension import load

    log.info("building the CUDA int dequant extension (first use only)")
    return load(
        name="compress_int_dequant",
        sources=[str(s) for s in SOURCES],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
    )


def dequantize(desc: GroupPacked) -> torch.Tensor:
    """Float32 ``[N, K]`` weight of ``desc`` (CUDA tensors)."""
    # float32 scales with the original strides, so the descriptor's scale strides still apply
    scales = torch.empty_strided(desc.scales.shape, desc.scales.stride(), dtype=torch.float32, device=desc.device)
    scales.copy_(desc.scales)
    return _extension().dequantize(
        desc.words, *desc.word_strides, scales, *desc.scale_strides,
        desc.zeros, *desc.zero_strides, desc.zero_offset,
        desc.g_idx, desc.group_width, desc.bits, desc.out_features, desc.in_features,
    )
