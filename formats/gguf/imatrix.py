"""llama.cpp importance-matrix files (GGUF form), read and written.

Layout (llama.cpp ``tools/imatrix/imatrix.cpp`` writer, ``common/imatrix-loader.cpp`` reader):
KV ``general.type = "imatrix"``, ``imatrix.datasets`` (string[]), ``imatrix.chunk_count`` (u32),
``imatrix.chunk_size`` (u32); for every weight, named by its GGUF tensor name ``W``, two F32 tensors:
``W.in_sum2`` with ``ne = [in_features, n_mat]`` (the sum over all tokens of each input activation
squared) and ``W.counts`` with ``ne = [1, n_mat]`` (tokens seen); ``n_mat`` is 1 for dense weights.
``llama-quantize`` uses ``in_sum2 / counts`` (1 where the count is 0) as the per-column importance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compress.errors import CompressError
from compress.formats.gguf.writer import atomic_gguf_writer


@dataclass
class ImatrixEntry:
    in_sum2: np.ndarray  # [in_features] float64 accumulators
    count: int = 0

    def importance(self) -> np.ndarray:
        """Mean squared activation per input column (llama-quantize's ``load_imatrix``)."""
        if self.count <= 0:
            return np.ones_like(self.in_sum2, dtype=np.float32)
        return (self.in_sum2.astype(np.float32) / np.float32(self.count)).astype(np.float32)


@dataclass
class Imatrix:
    entries: dict[str, ImatrixEntry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0


def write_imatrix(path: Path, imatrix: Imatrix) -> None:
    """Write ``imatrix`` to ``path`` atomically (temporary name, then rename)."""
    with atomic_gguf_writer(path, arch="") as writer:
        writer.kv_data[0].pop("general.architecture", None)  # an imatrix file names no architecture
        writer.add_type("imatrix")
        writer.add_array("imatrix.datasets", imatrix.datasets or ["unknown"])
        writer.add_uint32("imatrix.chunk_count", imatrix.chunk_count)
        writer.add_uint32("imatrix.chunk_size", imatrix.chunk_size)
        for name in sorted(imatrix.entries):
            entry = imatrix.entries[name]
            writer.add_tensor(f"{name}.in_sum2", entry.in_sum2.astype(np.float32).reshape(1, -1))
            writer.add_tensor(f"{name}.counts", np.array([[entry.count]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()


def read_imatrix(path: Path) -> Imatrix:
    """Read a GGUF imatrix file (dense entries; MoE entries with several matrices are refused)."""
    from gguf import GGUFReader

    if not path.is_file():
        raise CompressError(f"imatrix file {path} does not exist: write one with `compress imatrix` or llama-imatrix")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf-py raises ValueError/struct errors on foreign files
        raise CompressError(f"{path} is not a GGUF imatrix file ({type(exc).__name__}): convert legacy .dat files with llama-imatrix") from None
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("general.type", "imatrix."))}
    if fields.get("general.type") != "imatrix":
        raise CompressError(f"{path} is a GGUF file but not an imatrix (general.type is {fields.get('general.type')!r})")
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    out = Imatrix(datasets=list(fields.get("imatrix.datasets", [])), chunk_count=int(fields.get("imatrix.chunk_count", 0)),
                  chunk_size=int(fields.get("imatrix.chunk_size", 0)))
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        counts = tensors.get(f"{base}.counts")
        if counts is None or counts.size != 1:
            raise CompressError(f"{path}: entry {base} has {0 if counts is None else counts.size} counts; only dense (non-MoE) weights are supported")
        out.entries[base] = ImatrixEntry(sums.reshape(-1).astype(np.float64), int(round(float(counts.reshape(-1)[0]))))
    return out
