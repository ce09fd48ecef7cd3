"""Bit packing of unsigned integer codes into int32 words: the codec under every packed layout.

Layout (compressed-tensors ``pack_to_int32`` since PR #732, and AutoGPTQ's ``qweight``/``qzeros``; see
../shared/reference/formats.md §1.2 and §3.2): along the packed dimension, element ``k`` occupies bits
``[k·b, k·b + b)`` of a little-endian stream of 32-bit words, least significant bit first. A code may
straddle two words when ``32 % b != 0`` (3-bit: 10 + 1 split + 10 + 1 split + 10 codes per 3 words,
AutoGPTQ's ``qlinear_cuda_old`` layout). ``n`` codes take ``ceil(n·b / 32)`` words; the unused high bits
of the last word are zero.

Shapes: ``pack(codes [..., n, ...], bits, dim) -> int32 [..., ceil(n·b/32), ...]``;
``unpack(words, bits, n, dim)`` is its inverse. Words hold raw bit patterns, so a word with bit 31 set
reads as a negative int32. Both functions are pure.
"""

from __future__ import annotations

import math
import sys

import torch

from compress.quantizers import pages

_WORD = 32
_LOW32 = 0xFFFFFFFF


def packed_length(n: int, bits: int) -> int:
    """Number of int32 words holding ``n`` codes of ``bits`` bits."""
    return math.ceil(n * bits / _WORD)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bit width must be between 1 and 8, got {bits}")


def _positions(bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For the 32 codes of one chunk (which fill exactly ``bits`` words): word index and bit shift."""
    start = torch.arange(_WORD, device=device, dtype=torch.int64) * bits
    return start // _WORD, start % _WORD


def pack(codes: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along ``dim`` into int32 words (see module docstring)."""
    _check_bits(bits)
    x = codes.movedim(dim, -1)
    if x.numel():
        low, high = torch.aminmax(x)
        if int(low) < 0 or int(high) >= 1 << bits:
            raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] to pack into {bits} bits")
    n = x.shape[-1]
    lead = x.shape[:-1]
    if 8 % bits == 0 and sys.byteorder == "little":
        # whole codes per byte (2, 4, 8 bits): the stream's bytes built as uint8, then read as the int32 words
        # they are on a little-endian host (several times faster than assembling 64-bit words)
        # (a layer's codes are large: the bytes and the shifted codes go in buffers of their own, `pages.empty`)
        per, padding = 8 // bits, packed_length(n, bits) * (_WORD // bits) - n
        if x.dtype != torch.uint8:
            x = pages.empty(x.shape, torch.uint8).copy_(x)
        if padding:  # (a pad of nothing would still copy the codes)
            x = torch.nn.functional.pad(x, (0, padding))
        x = x.reshape(*lead, -1, per)
        stream = torch.bitwise_left_shift(x[..., per - 1], (per - 1) * bits, out=pages.empty(x.shape[:-1], torch.uint8))
        shifted = pages.empty(x.shape[:-1], torch.uint8) if per > 2 else None
        for k in range(per - 2, 0, -1):
            stream |= torch.bitwise_left_shift(x[..., k], k * bits, out=shifted)
        if per > 1:
            stream |= x[..., 0]
        return stream.contiguous().view(torch.int32).movedim(-1, dim)
    x = x.to(torch.int64)
    chunks = math.ceil(n / _WORD)
    x = torch.nn.functional.pad(x, (0, chunks * _WORD - n)).reshape(*lead, chunks, _WORD)
    word, shift = _positions(bits, x.device)
    out = torch.zeros(*lead, chunks, bits, dtype=torch.int64, device=x.device)
    # Bits of different codes never overlap, so adding them is the same as OR-ing them.
    out.index_add_(-1, word, (x << shift) & _LOW32)
    spill = shift + bits > _WORD  # codes straddling into the next word
    if bool(spill.any()):
        out.index_add_(-1, word[spill] + 1, x[..., spill] >> (_WORD - shift[spill]))
    out = out.reshape(*lead, chunks * bits)[..., : packed_length(n, bits)]
    out = torch.where(out >= 1 << 31, out - (1 << _WORD), out).to(torch.int32)  # raw bits as int32
    return out.movedim(-1, dim)


def unpack(words: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """The ``n`` codes (int32, in ``[0, 2**bits)``) packed along ``dim`` of the int32 ``words``."""
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {words.dtype}")
    if words.shape[dim] != packed_length(n, bits):
        raise ValueError(f"{n} codes of {bits} bits take {packed_length(n, bits)} words, got {words.shape[dim]}")
    if _WORD % bits == 0:  # no code straddles a word: shift and mask (the arithmetic shift's sign bits are masked off)
        w = words.movedim(dim, -1)
        shifts = torch.arange(0, _WORD, bits, device=w.device, dtype=torch.int32)
        codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*w.shape[:-1], -1)[..., :n].movedim(-1, dim)
    w = words.movedim(dim, -1).to(torch.int64) & _LOW32
    lead = w.shape[:-1]
    chunks = math.ceil(n / _WORD)
    w = torch.nn.functional.pad(w, (0, chunks * bits + 1 - w.shape[-1])).reshape(*lead, -1)
    base = (torch.arange(chunks, device=w.device) * bits).unsqueeze(-1)  # first word of each chunk
    word, shift = _positions(bits, w.device)
    index = (base + word).reshape(-1)
    low = w[..., index] >> shift.repeat(chunks)
    high = w[..., index + 1] << (_WORD - shift.repeat(chunks))  # 0 bits unless the code straddles
    codes = (low | high) & ((1 << bits) - 1)
    return codes[..., :n].to(torch.int32).movedim(-1, dim)
