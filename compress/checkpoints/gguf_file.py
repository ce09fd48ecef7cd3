"""A GGUF file opened with gguf-py, or its tensors' places from the header alone, or a one-line error: the one
place that reads GGUF headers from strangers.

`read_gguf` parses every metadata value (gguf-py builds a numpy view per element of an array: 4.5 s for SmolLM2's
49k-token vocabulary and merges, every time a GGUF was exported and its manifest written); `tensor_infos` walks
the same header skipping the values, for what needs only where each tensor lies (layout:
``../shared/reference/formats.md`` §4.1).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compress.errors import CompressError


def is_gguf_file(path: Path) -> bool:
    """A file that starts with the GGUF magic (directories and other files are not)."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf(path: Path):
    """gguf-py's reader on ``path`` (header, metadata and tensor infos parsed; data memory-mapped), or a
    one-line error."""
    from gguf import GGUFReader

    if not is_gguf_file(path):
        raise CompressError(f"{path} is not a GGUF file (no GGUF magic): give a .gguf file or a checkpoint directory")
    try:
        return GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OverflowError, MemoryError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:120]
        raise CompressError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {first}): re-download or re-export it") from None


def dequantized(path: Path, tensor) -> np.ndarray:
    """A tensor of gguf-py's reader decoded to floats by gguf-py, or a one-line error naming it: a block
    type gguf-py cannot decode, a shape its data does not fill, or NaN/Inf values."""
    from gguf import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:  # noqa: BLE001 - gguf-py raises many types on a damaged block
        raise CompressError(f"{path}: tensor {tensor.name} cannot be decoded ({type(exc).__name__}): the file is damaged; re-download or re-export it") from None
    if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values.sum(dtype=np.float64)) and not np.isfinite(values).all():
        raise CompressError(f"{path}: tensor {tensor.name} holds NaN or Inf values: the file is damaged; re-download or re-export it")
    return values


GGUF_MAGIC, DEFAULT_ALIGNMENT, MAX_DIMS = b"GGUF", 32, 4
# bytes of each fixed-size metadata value type (8: string, 9: array: variable)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as the header places it: ``shape`` is GGUF's ``ne`` (contiguous dimension first), ``data_offset``
    the absolute byte where its data starts (it may lie past the end of a truncated file: callers check)."""

    name: str
    tensor_type: int  # the ggml type id
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int


class _Header:
    """Little-endian values read in order from a memory map, every read bounds-checked."""

    def __init__(self, view: mmap.mmap):
        self.view, self.at = view, 0

    def take(self, count: int) -> int:
        start = self.at
        if count < 0 or start + count > len(self.view):
            raise ValueError(f"the header runs past the end of the file (at byte {start})")
        self.at = start + count
        return start

    def number(self, fmt: str) -> int:
        return struct.unpack_from(fmt, self.view, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        length = self.number("<Q")
        return self.view[self.take(length) : self.at]

    def skip_value(self, kind: int) -> object:
        """Skip one value of type ``kind``; returns it when it is a uint32 (the alignment), else None."""
        if kind == _UINT32:
            return self.number("<I")
        if kind in _VALUE_BYTES:
            self.take(_VALUE_BYTES[kind])
        elif kind == _STRING:
            self.take(self.number("<Q"))
        elif kind == _ARRAY:
            inner, count = self.number("<I"), self.number("<Q")
            if inner in _VALUE_BYTES or inner == _UINT32:
                self.take(count * _VALUE_BYTES.get(inner, 4))
            elif inner == _STRING:
                if count * 8 > len(self.view) - self.at:  # each string takes 8 bytes at least
                    raise ValueError(f"an array claims {count} strings")
                for _ in range(count):
                    self.take(self.number("<Q"))
            else:
                raise ValueError(f"an array of value type {inner} (arrays of arrays are not GGUF)")
        else:
            raise ValueError(f"unknown metadata value type {kind}")
        return None


def tensor_infos(path: Path) -> list[TensorInfo]:
    """Each tensor's name, type, shape and bytes, from the header with the metadata values skipped (not parsed), or a
    one-line error (little-endian GGUF v2/v3, as written by gguf-py and llama.cpp)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not is_gguf_file(path):
        raise CompressError(f"{path} is not a GGUF file (no GGUF magic): give a .gguf file or a checkpoint directory")
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            header = _Header(view)
            header.take(4)
            version = header.number("<I")
            if version not in (2, 3):
                raise ValueError(f"version {version} (2 and 3 are read; a big-endian file reads as another number)")
            tensor_count, kv_count = header.number("<Q"), header.number("<Q")
            if tensor_count + kv_count > len(view):
                raise ValueError(f"it claims {tensor_count} tensors and {kv_count} metadata keys")
            alignment = DEFAULT_ALIGNMENT
            for _ in range(kv_count):
                key, kind = header.string(), header.number("<I")
                value = header.skip_value(kind)
                if key == b"general.alignment":
                    if kind != _UINT32 or not value or value & (value - 1):
                        raise ValueError("general.alignment is not a power of two (uint32)")
                    alignment = value
            raw = []
            for _ in range(tensor_count):
                name, dims = header.string().decode(), header.number("<I")
                if dims > MAX_DIMS:
                    raise ValueError(f"tensor {name} has {dims} dimensions")
                shape = tuple(header.number("<Q") for _ in range(dims))
                raw.append((name, header.number("<I"), shape, header.number("<Q")))
            data_start = -(-header.at // alignment) * alignment
        infos = []
        for name, kind, shape, offset in raw:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            elements = int(np.prod(shape, dtype=object))
            if elements % block:
                raise ValueError(f"tensor {name} has {elements} values, not whole blocks of {block}")
            infos.append(TensorInfo(name, kind, shape, data_start + offset, elements // block * type_bytes))
        return infos
    except (ValueError, KeyError, OverflowError, UnicodeDecodeError, struct.error) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:120]
        raise CompressError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {first}): re-download or re-export it") from None


@dataclass(frozen=True)
class MappedTensor:
    """A tensor's bytes, memory-mapped, with what `dequantized` reads (as gguf-py's reader tensors have)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's ne: the contiguous dimension first
    data: np.ndarray  # uint8 [n_bytes]


def whole_tensor_infos(path: Path) -> list[TensorInfo]:
    """`tensor_infos`, each tensor's bytes checked to lie inside the file: a file that ends inside one is a one-line
    error."""
    infos, size = tensor_infos(path), path.stat().st_size
    for info in infos:
        if info.data_offset + info.n_bytes > size:
            raise CompressError(f"{path} is truncated: tensor {info.name} ends at byte {info.data_offset + info.n_bytes} of {size}")
    return infos


def mapped_tensors(path: Path) -> list[MappedTensor]:
    """Every tensor of ``path`` (`whole_tensor_infos`) over one read-only memory map."""
    from gguf import GGMLQuantizationType

    infos = whole_tensor_infos(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return [MappedTensor(i.name, GGMLQuantizationType(i.tensor_type), i.shape, data[i.data_offset : i.data_offset + i.n_bytes]) for i in infos]
