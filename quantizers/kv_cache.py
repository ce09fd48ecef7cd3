"""KV-cache formats: the quantize-dequantize round trip of the keys and values a serving engine stores.

A tensor of keys or values has transformers' cache layout ``[batch, kv_heads, seq, head_dim]`` (keys
after RoPE); `quantize_kv` returns what the engine reads back from its cache, in the input's dtype.

- ``fp8``: FP8 E4M3 (``float8_e4m3fn``, largest value 448), ``x ≈ s·e4m3(x/s)``: ``x/s`` is clamped to
  ±448 and rounded to the nearest E4M3 value, ties to even (torch's cast), as vLLM's fp8 KV cache with
  ``k_scale``/``v_scale``. ``s`` is a calibrated scale per tensor (or per KV head); without one, the
  dynamic ``amax(x)/448`` of the tensor at hand. `FP8Rounding.toward_zero` instead keeps the largest-magnitude
  E4M3 value not above ``|x·(1/s)|``: what vLLM's CPU cache writes (its ``float_to_fp8e4m3_scalar`` takes the top
  bits of the float32 value, no rounding), ~4 % smaller magnitudes on average where nearest loses ~0.2 %.
- ``int8``/``int4``: symmetric integers. Dynamic (no calibrated scale): one scale per token and head,
  ``s = max|x|/qmax`` over the head's ``head_dim`` values, ``q = round(x/s)`` (half to even) in
  ``[−qmax, qmax]`` (qmax 127, 7). Static (a calibrated per-tensor/per-head scale, compressed-tensors'
  int ``kv_cache_scheme``): ``q = clamp(round(x/s), −2^(b−1), 2^(b−1)−1)``, compressed-tensors' rounding.
- ``q8_0``/``q4_0``: llama.cpp's cache types: each head vector is cut into blocks of 32 along
  ``head_dim`` and every block goes through ggml's reference quantizer and decoder (`formats.gguf`'s
  codecs: Q8_0 ``d = max|x|/127`` with codes in int8; Q4_0 ``d = m/−8``, 4-bit codes, fp16 ``d``).

Calibrated scales (`scale_from_amax`) follow compressed-tensors' ``calculate_qparams``: ``amax`` over the
calibration tokens divided by half the format's range (448 for E4M3, 127.5 for int8).
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from compress.errors import CompressError
from compress.formats.gguf.codecs import decode_tensor, encode_tensor
from compress.formats.gguf.sizes import GGMLType
from compress.quantizers.grid import divide

FP8_E4M3_MAX = 448.0
GGML_BLOCK = 32  # values per Q8_0 / Q4_0 block


class KVCacheFormat(str, enum.Enum):
    fp8 = "fp8"
    int8 = "int8"
    int4 = "int4"
    q8_0 = "q8_0"
    q4_0 = "q4_0"

    @property
    def bits(self) -> int:
        return 4 if self in (KVCacheFormat.int4, KVCacheFormat.q4_0) else 8

    @property
    def calibrated(self) -> bool:
        """Whether the format takes a calibrated scale that compressed-tensors / vLLM store (fp8, int8)."""
        return self in (KVCacheFormat.fp8, KVCacheFormat.int8)


class FP8Rounding(str, enum.Enum):
    """How a value between two E4M3 values is stored: ``nearest`` (ties to even; torch's cast, compressed-tensors,
    vLLM on GPU) or ``toward-zero`` (vLLM's CPU attention cache)."""

    nearest = "nearest"
    toward_zero = "toward-zero"


def require_float8() -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        raise CompressError(f"torch {torch.__version__} has no float8_e4m3fn dtype: an fp8 KV cache needs torch >= 2.1")


def _broadcast_scale(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-tensor (1 value) or per-KV-head (``heads`` values) scale as ``[1, heads, 1, 1]`` float32."""
    s = scale.detach().to(device=x.device, dtype=torch.float32).reshape(-1)
    heads = x.shape[1]
    if s.numel() == 1:
        return s.reshape(1, 1, 1, 1)
    if s.numel() != heads:
        raise CompressError(f"a KV-cache scale has {s.numel()} values for {heads} KV heads: give one per tensor or one per head")
    return s.reshape(1, heads, 1, 1)


def _positive(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, s, torch.ones_like(s))  # an all-zero tensor or head stays zero with scale 1


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor | None = None, rounding: FP8Rounding = FP8Rounding.nearest) -> torch.Tensor:
    """``s·e4m3(clamp(x/s, ±448))``; ``scale`` per tensor or per head, else dynamic ``amax(x)/448``."""
    require_float8()
    xf = x.float()
    s = _positive(xf.abs().amax() / FP8_E4M3_MAX).reshape(1, 1, 1, 1) if scale is None else _broadcast_scale(scale, x)
    if rounding == FP8Rounding.nearest:
        q = (xf / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return (q.float() * s).to(x.dtype)
    y = (xf * (1.0 / s)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # vLLM multiplies by the scale's float32 reciprocal
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    rounded_up = codes.view(torch.float8_e4m3fn).float().abs() > y.abs()
    codes = torch.where(rounded_up, codes - 1, codes)  # E4M3 codes grow with magnitude: one code down is toward zero
    return (codes.view(torch.float8_e4m3fn).float() * s).to(x.dtype)


def int_round_trip(x: torch.Tensor, bits: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric ``bits``-bit integers: dynamic per (token, head) without ``scale``, else static."""
    xf = x.float()
    if scale is None:
        qmax = (1 << (bits - 1)) - 1
        s = _positive(divide(xf.abs().amax(dim=-1, keepdim=True), qmax))  # the same quotient on every device
        lo, hi = -qmax, qmax
    else:
        s = _broadcast_scale(scale, x)
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return (torch.clamp(torch.round(xf / s), lo, hi) * s).to(x.dtype)


def ggml_round_trip(x: torch.Tensor, kind: GGMLType) -> torch.Tensor:
    """Encode every head vector in ``kind``'s blocks of 32 along head_dim with ggml's reference
    quantizer, and decode it: the values llama.cpp's attention reads from such a cache."""
    head_dim = x.shape[-1]
    if head_dim % GGML_BLOCK:
        raise CompressError(
            f"head_dim {head_dim} is not a multiple of {GGML_BLOCK}: a {kind.name} KV cache stores blocks of {GGML_BLOCK} values "
            "along it (llama.cpp refuses it too); choose fp8, int8 or int4"
        )
    rows = x.detach().float().reshape(-1, head_dim).cpu().numpy().astype(np.float32, copy=False)
    decoded = decode_tensor(encode_tensor(rows, kind), kind, head_dim)
    return torch.from_numpy(decoded).reshape(x.shape).to(device=x.device, dtype=x.dtype)


def quantize_kv(
    x: torch.Tensor, fmt: KVCacheFormat, scale: torch.Tensor | None = None, rounding: FP8Rounding = FP8Rounding.nearest
) -> torch.Tensor:
    """The cached keys or values ``x [batch, kv_heads, seq, head_dim]`` after a round trip through ``fmt``.

    ``scale``: a calibrated scale (fp8, int8; one value, or one per KV head); None: dynamic scales.
    ``rounding``: how fp8 stores a value between two E4M3 values (the other formats round to nearest).
    """
    if x.dim() != 4:
        raise CompressError(f"KV states have shape {tuple(x.shape)}: expected [batch, kv_heads, seq, head_dim]")
    if scale is not None and not fmt.calibrated:
        raise CompressError(f"a {fmt.value} KV cache takes no calibrated scale: its scales are per block or per token")
    if fmt == KVCacheFormat.fp8:
        return fp8_round_trip(x, scale, rounding)
    if fmt in (KVCacheFormat.int8, KVCacheFormat.int4):
        return int_round_trip(x, fmt.bits, scale)
    return ggml_round_trip(x, GGMLType.Q8_0 if fmt == KVCacheFormat.q8_0 else GGMLType.Q4_0)


def scale_from_amax(amax: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """Static scale(s) for values whose calibrated absolute maximum is ``amax`` (any shape), float32."""
    if fmt == KVCacheFormat.fp8:
        half_range = FP8_E4M3_MAX
    elif fmt == KVCacheFormat.int8:
        half_range = 255 / 2  # compressed-tensors: (q_max − q_min) / 2
    else:
        raise CompressError(f"a {fmt.value} KV cache has no calibrated scale: calibrate fp8 or int8")
    scale = divide(amax.float(), half_range)
    return torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).eps))
