"""llama.cpp importance-matrix files (GGUF form), read and written.

Layout (llama.cpp ``tools/imatrix/imatrix.cpp`` writer, ``common/imatrix-loader.cpp`` reader):
KV ``general.type = "imatrix"``, ``imatrix.datasets`` (string[]), ``imatrix.chunk_count`` (u32),
``imatrix.chunk_size`` (u32); for every weight, named by its GGUF tensor name ``W``, two F32 tensors:
``W.in_sum2`` with ``ne = [in_features, n_mat]`` (the sum over all tokens of each input activation
squared) and ``W.counts`` with ``ne = [1, n_mat]`` (tokens seen); ``n_mat`` is 1 for dense weights and
the number of experts for MoE expert tensors (``ffn_*_exps``: one row of sums per expert, over the tokens the
router sent to it, and one count per expert, ``llama-imatrix``'s ``GGML_OP_MUL_MAT_ID`` branch).
``llama-quantize`` uses ``in_sum2 / counts`` (1 where the count is 0) as the per-column importance, row by
row: expert ``e`` of a stacked tensor is rounded with row ``e``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compress.errors import CompressError
from compress.formats.gguf.writer import atomic_gguf_writer


@dataclass
class ImatrixEntry:
    """One weight's sums: dense ``in_sum2 [in_features]`` with an int ``count``, or MoE experts'
    ``in_sum2 [n_expert, in_features]`` with ``count [n_expert]`` (float64 sums, integer counts)."""

    in_sum2: np.ndarray
    count: int | np.ndarray = 0

    @classmethod
    def experts(cls, n_expert: int, in_features: int) -> "ImatrixEntry":
        return cls(np.zeros((n_expert, in_features)), np.zeros(n_expert, dtype=np.int64))

    @property
    def n_mat(self) -> int:
        """1 for a dense weight, the number of experts for a stacked expert tensor."""
        return 1 if self.in_sum2.ndim == 1 else self.in_sum2.shape[0]

    def counts(self) -> np.ndarray:
        """``[n_mat]`` token counts."""
        return np.atleast_1d(np.asarray(self.count, dtype=np.int64))

    def importance(self, expert: int | None = None) -> np.ndarray:
        """Mean squared activation per input column (llama-quantize's ``load_imatrix``), float32 ``[in_features]``:
        of the dense weight, or (``expert``) of that expert's row; all ones where no token was seen."""
        if (expert is None) != (self.n_mat == 1):
            raise CompressError(f"an imatrix entry with {self.n_mat} matrices used for "
                                f"{'a dense weight' if expert is None else f'expert {expert}'}: the imatrix was made for another model")
        row = 0 if expert is None else expert
        if row >= self.n_mat:
            raise CompressError(f"the imatrix entry has {self.n_mat} experts, not {row + 1}: it was made for another model")
        sums, count = np.atleast_2d(self.in_sum2)[row], self.counts()[row]
        if count <= 0:
            return np.ones_like(sums, dtype=np.float32)
        return (sums.astype(np.float32) / np.float32(count)).astype(np.float32)


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
            sums = np.atleast_2d(entry.in_sum2).astype(np.float32)  # numpy [n_mat, in] is ne = [in, n_mat]
            writer.add_tensor(f"{name}.in_sum2", sums)
            writer.add_tensor(f"{name}.counts", entry.counts().astype(np.float32).reshape(-1, 1))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()


def read_imatrix(path: Path) -> Imatrix:
    """Read a GGUF imatrix file (dense entries and MoE experts' entries with one row per expert)."""
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
        if counts is None or counts.size == 0 or sums.size % counts.size:
            raise CompressError(f"{path}: entry {base} has {sums.size} sums and {0 if counts is None else counts.size} counts, "
                                "not a whole row per count: the file is damaged, collect it again")
        for label, values in (("sums of squared activations", sums), ("token counts", counts)):
            if not (np.isfinite(values).all() and (values >= 0).all()):  # else the fits' weights: NaN scales, ...
                raise CompressError(f"{path}: entry {base} has negative or non-finite {label}: "
                                    "the file is damaged, collect it again (compress imatrix or llama-imatrix)")
        n_mat = counts.size
        rounded = np.rint(counts.reshape(-1).astype(np.float64)).astype(np.int64)  # llama.cpp's lround
        sums64 = sums.reshape(n_mat, -1).astype(np.float64)
        out.entries[base] = (ImatrixEntry(sums64[0], int(rounded[0])) if n_mat == 1 else ImatrixEntry(sums64, rounded))
    return out
