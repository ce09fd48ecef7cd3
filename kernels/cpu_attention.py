"""Causal self-attention of bfloat16 tensors on the CPU, compiled (``csrc/attention.c``), where the CPU multiplies
bfloat16 pairs (AVX512-BF16).

``causal_attention_bf16(query, key, value, scale)`` is ``scaled_dot_product_attention(query, key, value,
is_causal=True, scale=scale, enable_gqa=True)`` with torch's CPU flash arithmetic (float32 scores from exact
products, bfloat16 probabilities times the values, float32 sums; the C file says which steps), returned as
``[batch, tokens, heads, dim]`` (the layout the attention layers' output projection reads). Only the order of the
float32 sums and the exponential's last bit differ from torch's kernel, so the outputs agree to a bfloat16 rounding
now and then, not bit for bit. It is there because torch's bfloat16 attention runs its products in float32 on a CPU
whose BLAS has no bfloat16 product (MKL on AMD: about a fifth of this loop's rate).

`usable` says where it runs: a CPU with the instructions (`compress.quantizers.gram.cpu_multiplies_bf16`), the
compiled library built (``COMPRESS_NATIVE=0`` asks for torch's kernel everywhere), bfloat16 CPU tensors ``query
[batch, heads, tokens, dim]`` and ``key``/``value [batch, kv_heads, tokens, dim]`` (any strides but a contiguous
last dimension), ``dim`` a multiple of 32 up to 256.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import torch

from compress.quantizers import gram
from compress.quantizers.native import compiled
from compress.quantizers.threads import even_runs, share_runs

SOURCE = Path(__file__).parent / "csrc" / "attention.c"
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = (("attention_bf16_causal", (_I64,) * 6 + (_PTR,) * 6 + (_F32, _PTR)),)
DIM_STEP, MAX_DIM = 32, 256  # the value loop's 32 dimensions at a time; the packed buffers' sizes assume no more


def _library():
    library = compiled(SOURCE, SIGNATURES) if gram.cpu_multiplies_bf16() else None
    if library is not None:
        library.attention_bf16_causal.restype = ctypes.c_int
    return library


def available() -> bool:
    """Whether the compiled loop runs on this machine at all (the instructions, the library built)."""
    return _library() is not None


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `causal_attention_bf16` runs for these tensors on this machine."""
    tensors = (query, key, value)
    if any(t.device.type != "cpu" or t.dtype != torch.bfloat16 or t.dim() != 4 or t.stride(-1) != 1 for t in tensors):
        return False
    (batch, heads, tokens, dim), kv = query.shape, key.shape
    return (kv == value.shape and kv[0] == batch and kv[2] == tokens and kv[3] == dim and tokens > 0
            and kv[1] > 0 and heads % kv[1] == 0 and dim % DIM_STEP == 0 and dim <= MAX_DIM and _library() is not None)


def causal_attention_bf16(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``query [batch, heads, tokens, dim]`` over ``key``/``value [batch, kv_heads, tokens,
    dim]`` (query head ``h`` reads kv head ``h // (heads / kv_heads)``): ``[batch, tokens, heads, dim]`` bfloat16
    (`usable` must hold). The (batch, head) pairs are shared among torch's thread count, the first on this thread."""
    library = _library()
    batch, heads, tokens, dim = query.shape
    out = torch.empty(batch, tokens, heads, dim, dtype=torch.bfloat16)
    strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (query, key, value)]
    pointers = (query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr())

    def run(u0: int, u1: int) -> int:
        return library.attention_bf16_causal(u0, u1, heads, key.shape[1], tokens, dim, pointers[0], strides[0],
                                             pointers[1], strides[1], pointers[2], strides[2], scale, pointers[3])

    units = batch * heads
    parts = max(1, min(torch.get_num_threads(), units))
    with ThreadPoolExecutor(parts - 1) if parts > 1 else nullcontext() as pool:
        failed = sum(share_runs(pool, run, even_runs(units, parts)))
    if failed:
        raise MemoryError("no memory for the attention's buffers")
    return out
