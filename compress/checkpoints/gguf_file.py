"""A GGUF file opened with gguf-py, or a one-line error: the one place that reads GGUF headers from strangers."""

from __future__ import annotations

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
