"""Candidate storage schemes for one weight matrix, by name, and the bytes each takes as stored.

Two families, never mixed in one plan:

- integer grids written as compressed-tensors ``pack-quantized`` (symmetric, see `compressed_tensors`):
  ``w<bits>g<group>`` (e.g. ``w4g128``) or ``w<bits>`` (one group per output channel). A layer ``[out, in]``
  stores ``weight_packed`` (``out · ceil(in·bits/32)`` int32 words), ``weight_scale`` (``out · groups``
  values in the checkpoint's dtype) and ``weight_shape`` (two int64);
- GGML types written in GGUF (``q2_k`` ... ``q8_0``, ``f16``; `gguf.sizes`): ``rows · row_bytes``. A type
  whose block does not divide the row length falls back as llama.cpp's ``tensor_type_fallback`` does
  (`gguf.plan.FALLBACK`, then F16), and the candidate is measured and sized as that type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from compress.errors import CompressError
from compress.formats.gguf.plan import BASE, FALLBACK, PRESETS, Target
from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType, row_bytes
from compress.formats.packing import packed_length
from compress.quantizers.grid import MAX_BITS, MIN_BITS, QuantScheme

_INT = re.compile(r"w(\d+)(?:g(\d+))?$")


@dataclass(frozen=True)
class Candidate:
    """One way to store a weight matrix: an integer grid (``scheme``) or a GGML type (``ggml``)."""

    name: str
    scheme: QuantScheme | None = None
    ggml: GGMLType | None = None

    @property
    def is_gguf(self) -> bool:
        return self.ggml is not None

    def stored_type(self, cols: int) -> GGMLType | None:
        """The GGML type a row of ``cols`` values is written in (after llama.cpp's fallbacks)."""
        if self.ggml is None:
            return None
        kind = self.ggml
        if cols % BLOCK_SIZES[kind][0]:
            kind = FALLBACK.get(kind, kind)
            if cols % BLOCK_SIZES[kind][0]:
                kind = GGMLType.F16
        return kind

    def stored_bytes(self, out_features: int, in_features: int, scale_bytes: int = 2) -> int | None:
        """Bytes of one ``[out, in]`` matrix stored this way (None: this grid cannot store it);
        ``scale_bytes``: the size of one compressed-tensors scale (the checkpoint dtype's)."""
        if self.ggml is not None:
            return out_features * row_bytes(self.stored_type(in_features), in_features)
        scheme = self.scheme
        if scheme.group_size != -1 and in_features % scheme.group_size:
            return None
        words = out_features * packed_length(in_features, scheme.bits)
        return 4 * words + out_features * scheme.groups(in_features) * scale_bytes + 2 * 8


def parse_candidate(text: str) -> Candidate:
    name = text.strip().lower()
    match = _INT.match(name)
    if match:
        bits, group = int(match.group(1)), int(match.group(2) or -1)
        if not MIN_BITS <= bits <= MAX_BITS or group == 0:
            raise CompressError(f"candidate {text!r}: bits must be {MIN_BITS} to {MAX_BITS} and the group size positive, e.g. w4g128")
        return Candidate(name, scheme=QuantScheme(bits, True, group))
    try:
        target = Target(name)
    except ValueError:
        target = None
    if target is None or target in PRESETS:
        raise CompressError(
            f"unknown candidate {text!r}: use integer grids such as w2g64, w3g128, w4g128, w8 (per channel) or GGML types "
            f"({', '.join(t.value for t in Target if t not in PRESETS)})"
        )
    return Candidate(name, ggml=BASE[target])


def parse_candidates(text: str | list[str]) -> list[Candidate]:
    """``"w2g64,w3g128,w4g128,w8"`` or ``"q2_k,q3_k,q4_k,q5_k,q6_k,q8_0"`` (a list of names also works)."""
    names = [n for part in ([text] if isinstance(text, str) else text) for n in part.split(",") if n.strip()]
    if not names:
        raise CompressError("no candidates given: list some, e.g. --candidates w2g64,w3g128,w4g128,w8")
    candidates = list({c.name: c for c in map(parse_candidate, names)}.values())
    if len({c.is_gguf for c in candidates}) > 1:
        raise CompressError("candidates mix integer grids and GGML types: measure one family at a time (w… for safetensors, q… for GGUF)")
    return candidates
