"""Byte sizes as users write them: ``2.1GB`` (decimal units), ``900MiB`` (binary) or a plain number of bytes."""

from __future__ import annotations

import re

from compress.errors import CompressError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """``"2.1GB"`` (decimal units), ``"900MiB"`` (binary) or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise CompressError(f"size {text!r} is not understood: write e.g. 2.1GB, 900MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
