"""Tensor-level checkpoint I/O: lazy reading and streamed, sharded writing.

Reading: a Hugging Face checkpoint directory's weights (``model.safetensors``, sharded safetensors with
``model.safetensors.index.json``, or ``pytorch_model.bin`` loaded only with ``weights_only=True``) are
indexed by name from the safetensors headers and read one tensor at a time, so nothing is read that is
not asked for. Tensors are read with plain positioned reads into fresh memory rather than through a
memory map: every touched page of a mapped file stays in the process's resident set (measured: reading
a 1 GB file tensor by tensor through ``safe_open`` left RSS 1 GB higher; plain reads, +4 MB), which
would defeat the one-block-at-a-time memory bound. Headers are validated up front so a truncated file
is a clear error, not a crash half-way through a run.

Writing: tensors are appended to a `ShardedWriter`, which flushes a shard file whenever the pending
bytes exceed the shard size; tensors are streamed to disk as they are added, so the writer holds
none in memory (``safetensors.torch.save_file`` needs every tensor of a shard in memory and first
copies each to ``bytes``, which doubled the peak).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
from compress.checkpoints.background import InOrder
from compress.errors import CompressError
from compress.quantizers import pages
from compress.quantizers.finite import all_finite

# safetensors dtype names (safetensors/src/tensor.rs) -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entries(path: Path, entries: dict[str, dict], data_len: int, fix: str) -> None:
    """Every tensor's dtype, shape and byte range are valid, agree with each other and with the file, and
    no two ranges overlap: a header that lies is an error here, before any allocation it asks for."""
    spans = []
    for name, entry in entries.items():
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise CompressError(f"{path}: tensor {name} has unsupported dtype {dtype}: convert the checkpoint")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise CompressError(f"{path}: tensor {name} has an invalid shape {shape!r}: {fix}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets) or offsets[0] > offsets[1]:
            raise CompressError(f"{path}: tensor {name} has invalid data_offsets {offsets!r}: {fix}")
        if offsets[1] > data_len:
            raise CompressError(f"{path} is truncated: tensor {name} ends at byte {offsets[1]} of a {data_len}-byte data section: {fix}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * SAFETENSORS_DTYPES[dtype].itemsize
        if nbytes != offsets[1] - offsets[0]:
            raise CompressError(
                f"{path}: tensor {name} has shape {shape} ({nbytes} bytes of {dtype}) but {offsets[1] - offsets[0]} bytes of data: {fix}"
            )
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CompressError(f"{path}: tensors {first} and {second} overlap in the data section: {fix}")


def _read_safetensors_header(path: Path) -> tuple[int, dict[str, dict]]:
    """Validate a safetensors file's header against its size; return (data start, tensor entries)."""
    size = path.stat().st_size
    fix = "re-download or re-save the checkpoint"
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CompressError(f"{path} is not a safetensors file (only {size} bytes): {fix}")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CompressError(f"{path} is truncated: its header needs {header_len} bytes, file has {size}: {fix}")
        try:
            header = json.loads(f.read(header_len).decode("utf-8"), object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, duplicate names, nested too deep
            problem = "nested too deep" if isinstance(exc, RecursionError) else str(exc).splitlines()[0][:80]
            raise CompressError(f"{path} has a corrupt safetensors header ({problem}): {fix}") from None
    entries = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    if entries is None or not all(isinstance(v, dict) for v in entries.values()):
        raise CompressError(f"{path} has a corrupt safetensors header: {fix}")
    _check_entries(path, entries, size - 8 - header_len, fix)
    return 8 + header_len, entries


def check_finite(path: Path, name: str, tensor: torch.Tensor) -> None:
    """A floating-point tensor holds no NaN or Inf, or a one-line error naming it (`all_finite`: one sum
    unless something is wrong)."""
    if all_finite(tensor):
        return
    values = tensor.float() if tensor.element_size() == 1 else tensor
    bad = int((~torch.isfinite(values)).sum())  # at least one: `all_finite` found it
    raise CompressError(
        f"{path}: tensor {name} holds {bad} NaN or Inf values of {values.numel()}: the checkpoint is corrupt; re-download it or repair that tensor"
    )


def _read_tensor(path: Path, data_start: int, entry: dict) -> torch.Tensor:
    tensor = pages.empty(entry["shape"], SAFETENSORS_DTYPES[entry["dtype"]])  # written once, in full, by the read
    begin, end = entry["data_offsets"]
    if end > begin:
        buffer = tensor.reshape(-1).view(torch.uint8).numpy()
        with path.open("rb", buffering=0) as f:
            f.seek(data_start + begin)
            if f.readinto(buffer) != end - begin:
                raise CompressError(f"{path} ended while reading a tensor: re-download or re-save the checkpoint")
    return tensor


class CheckpointReader:
    """Name → tensor access to a checkpoint directory's weights, one tensor at a time."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._file_of: dict[str, Path] = {}
        self._entries: dict[str, tuple[int, dict]] = {}
        self._bin_cache: dict[Path, dict[str, torch.Tensor]] = {}
        self.files: list[Path] = []
        for index_name in (SAFE_INDEX, BIN_INDEX):
            if (directory / index_name).is_file():
                self._read_index(directory / index_name)
                break
        else:
            for single in (SAFE_SINGLE, BIN_SINGLE):
                if (directory / single).is_file():
                    self._add_file(directory / single)
                    break
            else:
                raise CompressError(
                    f"no weights in {directory}: expected {SAFE_SINGLE}, {SAFE_INDEX} or {BIN_SINGLE}"
                )

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError):
            raise CompressError(f"{index} is not a valid weight index (no 'weight_map'): re-save the checkpoint") from None
        for file_name in sorted(set(weight_map.values())):
            path = self.directory / file_name
            if not path.is_file():
                raise CompressError(f"{index} lists {file_name}, which is missing: re-download the checkpoint")
            self._add_file(path)

    def _add_file(self, path: Path) -> None:
        self.files.append(path)
        if path.suffix == ".safetensors":
            data_start, entries = _read_safetensors_header(path)
            self._entries.update({name: (data_start, entry) for name, entry in entries.items()})
            names = list(entries)
        else:
            names = list(self._load_bin(path))
        for name in names:
            self._file_of[name] = path

    def _load_bin(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._bin_cache:
            try:
                self._bin_cache[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # pickle errors come in many types
                raise CompressError(f"cannot read {path} with weights_only=True ({type(exc).__name__}): convert it to safetensors") from None
        return self._bin_cache[path]

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read now; a floating-point one with NaN or Inf values is a `CompressError` naming it."""
        path = self._file_of[name]
        tensor = self._load_bin(path)[name] if path.suffix != ".safetensors" else _read_tensor(path, *self._entries[name])
        check_finite(path, name, tensor)
        return tensor

    def prefetch(self, names: Iterable[str]) -> threading.Thread | None:
        """Start reading these tensors' bytes into the OS's page cache on a thread of their own, so that their `get`
        finds them there while this thread works on: the next block's weights arrive during this block's work
        (an RTN of an 8B model reads 16 GB). Only a hint (``posix_fadvise``'s
        WILLNEED, which waits for the disk's queue, hence the thread): nothing is read into this process, a tensor
        in a pickle or a name not stored is passed over. Returns the thread (None: nothing to ask for)."""
        spans: dict[Path, list[tuple[int, int]]] = {}
        for name in names:
            path = self._file_of.get(name)
            if path is not None and path.suffix == ".safetensors":
                data_start, entry = self._entries[name]
                begin, end = entry["data_offsets"]
                spans.setdefault(path, []).append((data_start + begin, end - begin))
        if not spans or not hasattr(os, "posix_fadvise"):
            return None
        thread = threading.Thread(target=_advise_will_need, args=(spans,), name="compress-prefetch", daemon=True)
        thread.start()
        return thread

    def shape(self, name: str) -> list[int]:
        """The tensor's shape, from the safetensors header (nothing read) or the loaded pickle."""
        path = self._file_of[name]
        if path.suffix == ".safetensors":
            return list(self._entries[name][1]["shape"])
        return list(self._load_bin(path)[name].shape)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def _advise_will_need(spans: dict[Path, list[tuple[int, int]]]) -> None:
    for path, ranges in spans.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # a hint: the read that follows reports a missing file
        try:
            for offset, length in ranges:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _header_bytes(entries: list[tuple[str, torch.dtype, list[int], int]], metadata: dict[str, str] | None, room: int | None = None) -> bytes:
    """safetensors header for (name, dtype, shape, nbytes) entries laid out back to back: its length, then the JSON
    padded with spaces to a multiple of 8 bytes, or to fill exactly ``room`` bytes (length field included)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, size in entries:
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    padding = -len(encoded) % 8 if room is None else room - 8 - len(encoded)
    if padding < 0:
        raise ValueError(f"a safetensors header of {len(encoded) + 8} bytes does not fit its room of {room}")
    encoded += b" " * padding
    return struct.pack("<Q", len(encoded)) + encoded


def header_room(max_shard_bytes: int) -> int:
    """Bytes a `ShardedWriter` reserves for each shard's header: 1/1024 of the shard size (256 KB for 256 MB shards,
    ~2,000 tensors' entries), at least 4 KB; a multiple of 8, so the data start aligned."""
    return min(256 << 10, max(4096, max_shard_bytes // 1024 // 8 * 8))


_HEADER_OVERHEAD = 64  # the length field, braces and the {"__metadata__":{"format":"pt"}} entry: 8 + 2 + 32, rounded up


def _entry_bound(entry: tuple[str, torch.dtype, list[int], int], end: int) -> int:
    """At most the bytes ``entry``'s part of a header takes (its name, dtype, shape and offsets ending at ``end``,
    the comma before it), so that a shard's header is known to fit before the tensor is written."""
    name, dtype, shape, _ = entry
    return len(json.dumps(name)) + len(json.dumps(shape, separators=(",", ":"))) + 2 * len(str(end)) + 60


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file, streaming each tensor's bytes without an intermediate copy.

    Layout (huggingface/safetensors README): u64 little-endian header length, a JSON header mapping
    each name to dtype, shape and [begin, end) data offsets (padded with spaces to a multiple of 8),
    then the tensors' bytes, row-major, in header order.
    """
    entries = [(n, t.dtype, list(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()]
    with path.open("wb") as f:
        f.write(_header_bytes(entries, metadata))
        for t in tensors.values():
            if t.numel():
                f.write(_tensor_bytes(t))


class DiscardingWriter:
    """A writer that keeps nothing: the engine's output on a process that is not the one writing it."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def close(self) -> None:
        pass


# bytes of added tensors a `ShardedWriter`'s writing thread may have yet to write: about one 8B model's quantized block
WRITE_AHEAD = 512 << 20


class ShardedWriter:
    """Writes tensors to ``model-XXXXX-of-YYYYY.safetensors`` shards plus an index, streaming.

    A tensor's bytes go to the current shard file as soon as it is added, so the writer holds no tensors in
    memory. Each shard is written once: its data start after room reserved for the header (`header_room`),
    which is written into that room when the shard is finished, padded with spaces as the safetensors format
    allows; a shard is finished early when its header would outgrow the room. (Streaming the data to a file
    of their own and copying them behind the header wrote every byte of the output twice.)

    The file writes run in order on a thread of their own (`InOrder`), up to `WRITE_AHEAD` bytes behind `add`: the
    caller computes the next tensors while the kernel takes these (an RTN of an 8B model writes 5.8 GB). A tensor
    added is not to be changed afterwards. A failed write raises its exception from a later `add`, `state` or
    `close`.
    """

    def __init__(self, directory: Path, max_shard_bytes: int = 256 << 20):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.header_room = header_room(max_shard_bytes)
        self._entries: list[tuple[str, torch.dtype, list[int], int]] = []
        self._header_bound = 0  # an upper bound of the current shard's header bytes (`_entry_bound` summed)
        self._data = None  # the current shard's open file, positioned at the end of its data once the writes are done
        self._data_size = 0  # the current shard's data bytes, written or given to the writing thread
        self._shards: list[tuple[Path, list[str]]] = []
        self._writes = InOrder(WRITE_AHEAD, name="compress-writer")
        self.total_bytes = 0

    def _shard_path(self) -> Path:
        return self.directory / f"shard-{len(self._shards):05d}.tmp"

    def _data_bytes(self) -> int:
        return self._data_size if self._data is not None else 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu")
        size = t.numel() * t.element_size()
        entry = (name, t.dtype, list(t.shape), size)
        if _HEADER_OVERHEAD + _entry_bound(entry, size) > self.header_room:
            raise ValueError(f"tensor {name[:40]}... has too long a name or shape for a header of {self.header_room} bytes")
        bound = _entry_bound(entry, self._data_bytes() + size)
        if self._entries and _HEADER_OVERHEAD + self._header_bound + bound > self.header_room:
            self.flush()  # its header fills the room: the tensor starts the next shard
            bound = _entry_bound(entry, size)
        if self._data is None:
            self._data = self._shard_path().open("wb")
            self._data.seek(self.header_room)
            self._data_size = 0
        if size:
            data, file = _tensor_bytes(t), self._data
            self._writes.submit(lambda: file.write(data), size)
            self._data_size += size
        self._entries.append(entry)
        self._header_bound += bound
        if self._data_bytes() >= self.max_shard_bytes:
            self.flush()

    def state(self) -> dict:
        """What a resumed run needs to continue exactly here (JSON): the finished shards, the entries of the
        current one and its data bytes, which are pushed to the kernel first (a killed process loses nothing the
        kernel holds)."""
        self._writes.drain()
        if self._data is not None:
            self._data.flush()
        return {
            "shards": [[path.name, names] for path, names in self._shards],
            "entries": [[name, _DTYPE_NAMES[dtype], shape, size] for name, dtype, shape, size in self._entries],
            "data_bytes": self._data_bytes(),
            "total_bytes": self.total_bytes,
        }

    def restore(self, state: dict) -> None:
        """Continue where `state` was taken, in the folder of a killed run: later shards are dropped and the
        current shard is cut back to its recorded data (a header written into its room since is rewritten when
        the shard is finished again)."""
        self._writes.drain()
        self._shards = [(self.directory / name, list(names)) for name, names in state["shards"]]
        self._entries = [(name, SAFETENSORS_DTYPES[dtype], list(shape), size) for name, dtype, shape, size in state["entries"]]
        self.total_bytes = state["total_bytes"]
        missing = [path.name for path, _ in self._shards if not path.is_file()]
        if missing:
            raise CompressError(f"{self.directory} lacks {missing[0]}, which its progress record lists: it cannot be resumed; remove it")
        current = self._shard_path()
        for path in self.directory.glob("shard-*"):
            index = int(path.name[6:11]) if path.name[6:11].isdigit() else -1
            if index > len(self._shards) or (index == len(self._shards) and (path != current or not self._entries)):
                path.unlink()
        self._header_bound, offset = 0, 0
        for entry in self._entries:
            offset += entry[3]
            self._header_bound += _entry_bound(entry, offset)
        if self._entries:
            end = self.header_room + state["data_bytes"]
            if not current.is_file() or current.stat().st_size < end:
                raise CompressError(f"{current} is shorter than its progress record says: {self.directory} cannot be resumed; remove it")
            self._data = current.open("r+b")
            self._data.truncate(end)
            self._data.seek(end)
            self._data_size = state["data_bytes"]

    def flush(self) -> None:
        """Finish the current shard: its header, padded to the room before the data."""
        if self._data is None:
            return
        header, file = _header_bytes(self._entries, {"format": "pt"}, room=self.header_room), self._data

        def finish() -> None:
            file.seek(0)
            file.write(header)
            file.close()

        self._writes.submit(finish)
        self._shards.append((self._shard_path(), [e[0] for e in self._entries]))
        self.total_bytes += sum(e[3] for e in self._entries)
        self._entries, self._data, self._header_bound = [], None, 0

    def close(self) -> list[Path]:
        """Flush and give shards their final names (a single ``model.safetensors`` if only one)."""
        self.flush()
        self._writes.drain()
        count = len(self._shards)
        if count == 1:
            final = self.directory / SAFE_SINGLE
            os.replace(self._shards[0][0], final)
            return [final]
        weight_map: dict[str, str] = {}
        finals = []
        for i, (path, names) in enumerate(self._shards):
            final = self.directory / f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(path, final)
            finals.append(final)
            weight_map.update({n: final.name for n in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return finals
