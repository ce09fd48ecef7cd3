"""The packed-format writer for an `OutputFormat`: the one module that knows every packed layout (so the
base classes need not import the formats built on them)."""

from __future__ import annotations

from compress.formats.base import OutputFormat, PackFormat
from compress.formats.compressed_tensors import CompressedTensorsFormat
from compress.formats.gptq import GPTQFormat

_PACKERS: dict[OutputFormat, type[PackFormat]] = {
    OutputFormat.compressed_tensors: CompressedTensorsFormat,
    OutputFormat.gptq: GPTQFormat,
}


def make_format(kind: OutputFormat) -> PackFormat | None:
    """The writer for ``kind`` (None: fake quantization, dense weights)."""
    packer = _PACKERS.get(kind)
    return packer() if packer is not None else None
