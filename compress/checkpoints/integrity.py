"""Integrity of outputs: SHA-256 manifests, the digests of a run's inputs, and `verify`.

A manifest lists every file of an output with its size and SHA-256 (FIPS 180-4), and for safetensors and
GGUF files also the SHA-256 of each tensor's data bytes, so that a damaged file is reported with the
first tensor whose bytes changed::

    {"manifest": "llm-compress/1", "algorithm": "sha256",
     "files": {"model.safetensors": {"bytes": 10079688, "sha256": "…", "tensors": {"lm_head.weight": "…", …}}, …}}

An output directory holds it as ``manifest.json`` (written last, into the temporary directory, before the
rename). A GGUF file gets a sidecar ``<file>.manifest.json``: a file cannot hold its own digest, and GGUF's
metadata precedes the tensor data, which is streamed, so per-tensor digests are known only after the
metadata is on disk. What *is* known before the data, the provenance (tool version, command, settings,
input digests), is embedded in the GGUF metadata (`compress.export.gguf`).

`verify` checks a manifest (missing, truncated, changed or added files; the first tensor whose bytes
changed), then re-reads every tensor: safetensors headers validated, every floating-point tensor finite,
packed layers decoded through their codec (`compress.checkpoints.packed`), GGUF tensors dequantized by
gguf-py. Any damage is one `CompressError` line naming the file and the tensor.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

from compress.errors import CompressError

MANIFEST = "manifest.json"
MANIFEST_VERSION = "llm-compress/1"
CHUNK = 16 << 20  # bytes of an input read at once (`sha256_file`)
WINDOW = 64 << 20  # bytes of an output mapped at once (`_windows`)
ProgressFn = Callable[[str, int, int], None]


def sidecar_manifest(path: Path) -> Path:
    """Where the manifest of a single-file output (a GGUF file) lives."""
    return path.with_name(path.name + ".manifest.json")


# An output is hashed from its pages in the OS's cache, mapped a window at a time (`_windows`), not read into buffers of
# ours: a read copies every byte once more, and the output was just written, so its pages are there; a window bounds
# what the mapping adds to the process's resident memory. (An input, which may have to come from the disk, is read:
# its digests run beside the checkpoint's own reads, and mapped reads of a cold 16 GB model took longer there.) A
# file cut short while it is mapped would end the process (SIGBUS): what is hashed so is written and closed.
#
# Inputs are read into one buffer kept while the file is read: `f.read` would make each 16 MB chunk a fresh mapping
# (the allocator's threshold is 1 MB), zeroed by the kernel page by page and unmapped again.
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(CHUNK))
    with path.open("rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(buffer[:count])
    return digest.hexdigest()


def _windows(f, size: int) -> Iterator[tuple[int, memoryview]]:
    """Each `WINDOW` of the first ``size`` bytes of the open file ``f`` as ``(offset, bytes)``, mapped read-only for
    sequential reading; a window is unmapped once the next is asked for (hold no view of it past that)."""
    for offset in range(0, size, WINDOW):
        with mmap.mmap(f.fileno(), min(WINDOW, size - offset), access=mmap.ACCESS_READ, offset=offset) as mapped:
            if hasattr(mapped, "madvise"):
                mapped.madvise(mmap.MADV_SEQUENTIAL)  # read ahead of the hashing where the file is not cached
            with memoryview(mapped) as window:
                yield offset, window


def _gguf_spans(path: Path) -> list[tuple[int, int, str]]:
    from compress.checkpoints.gguf_file import whole_tensor_infos

    return [(t.data_offset, t.data_offset + t.n_bytes, t.name) for t in whole_tensor_infos(path)]


def _tensor_spans(path: Path, name: str | None = None) -> list[tuple[int, int, str]] | None:
    """Each tensor's [begin, end) bytes in the file (None: not a tensor file, by the suffix of ``name``, the
    file's final name, default its own); a damaged header raises."""
    suffix = Path(name or path.name).suffix
    if suffix == ".safetensors":
        from compress.checkpoints.shards import _read_safetensors_header

        start, entries = _read_safetensors_header(path)
        return [(start + e["data_offsets"][0], start + e["data_offsets"][1], name) for name, e in entries.items()]
    if suffix == ".gguf":
        return _gguf_spans(path)
    return None


def _digests(path: Path, spans: list[tuple[int, int, str]]) -> tuple[str, dict[str, str | None]]:
    """One pass over the file: its digest and each span's (None: the file ends inside it). Spans do not
    overlap (their readers check it). A tensor's bytes are hashed twice, for the file and for the tensor: the
    file's digest runs on a helper thread beside the tensors' (hashlib releases the interpreter's lock), window by
    window in order."""
    whole, tensors = hashlib.sha256(), {}
    pending = deque(sorted(spans))  # the spans not begun, in file order
    open_parts: dict = {}  # name -> (begin, end, its hash so far): the spans begun and not ended
    with path.open("rb") as f, ThreadPoolExecutor(1) as helper:
        size = os.fstat(f.fileno()).st_size
        for offset, window in _windows(f, size):
            hashing = helper.submit(whole.update, window)
            end_of_window = offset + len(window)
            while pending and pending[0][0] < end_of_window:
                begin, end, name = pending.popleft()
                open_parts[name] = (begin, end, hashlib.sha256())
            for name, (begin, end, part) in list(open_parts.items()):
                part.update(window[max(begin, offset) - offset : min(end, end_of_window) - offset])
                if end <= end_of_window:
                    tensors[name] = part.hexdigest()
                    del open_parts[name]
            hashing.result()  # before the window is unmapped
    unfinished = [(begin, end, name) for name, (begin, end, _) in open_parts.items()] + list(pending)
    for begin, end, name in unfinished:  # the file ends inside these or before them, unless empty
        tensors[name] = hashlib.sha256().hexdigest() if begin == end <= size else None
    return whole.hexdigest(), tensors


def file_entry(path: Path, name: str | None = None) -> dict:
    """A manifest entry: size, SHA-256 and, for tensor files, each tensor's SHA-256 in file order (``name``:
    the file's final name, when it is written under a temporary one)."""
    spans = _tensor_spans(path, name)
    digest, tensors = _digests(path, spans or [])
    entry: dict = {"bytes": path.stat().st_size, "sha256": digest}
    if spans is not None:  # where each tensor lies, so a damaged file is checked without trusting its header
        entry["tensors"] = {t: {"offset": begin, "bytes": end - begin, "sha256": tensors[t]} for begin, end, t in sorted(spans)}
    return entry


def _relative_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _manifest(files: dict[str, dict]) -> str:
    return json.dumps({"manifest": MANIFEST_VERSION, "algorithm": "sha256", "files": files}, indent=1) + "\n"


def write_manifest(directory: Path) -> Path:
    """``directory/manifest.json`` over every file below ``directory`` (the manifest itself excepted)."""
    files = {rel: file_entry(directory / rel) for rel in _relative_files(directory) if rel != MANIFEST}
    path = directory / MANIFEST
    path.write_text(_manifest(files))
    return path


def write_file_manifest(path: Path, name: str, destination: Path) -> None:
    """The manifest of the single file ``path`` (to be renamed ``name``), written to ``destination``."""
    destination.write_text(_manifest({name: file_entry(path, name)}))


def input_digests(path: Path, recursive: bool = False) -> dict:
    """The SHA-256 of an input, for a run's record: of the file, or of each file of the folder by relative
    path (top level only unless ``recursive``; hidden files skipped)."""
    path = Path(path)
    if path.is_file():
        return {"path": str(path), "sha256": {path.name: sha256_file(path)}}
    pattern = path.rglob("*") if recursive else path.iterdir()
    files = sorted(p for p in pattern if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    return {"path": str(path), "sha256": {p.relative_to(path).as_posix(): sha256_file(p) for p in files}}


# -- verification ------------------------------------------------------------------------------------
@dataclass
class VerifyResult:
    path: Path
    files: int
    bytes: int
    tensors: int  # tensors re-read (GGUF: dequantized)
    packed_layers: int  # packed layers decoded through their codec

    def to_dict(self) -> dict:
        return {**self.__dict__, "path": str(self.path)}


def _load_manifest(path: Path, output: Path) -> dict[str, dict]:
    if not path.is_file():
        raise CompressError(
            f"{output} has no manifest ({path.name}): it was not written by llm-compress, or the manifest was deleted; nothing to verify against"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if data.get("algorithm") != "sha256" or not all(isinstance(e, dict) and "sha256" in e and "bytes" in e for e in files.values()):
            raise ValueError("entries without sha256 and bytes")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CompressError(f"{path} is damaged ({type(exc).__name__}): re-create the output") from None
    return files


def _inside(root: Path, relative: str) -> Path:
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise CompressError(f"the manifest of {root} names {relative!r}, outside the output: the manifest is damaged")
    return root.joinpath(*parts)


def _check_file(path: Path, entry: dict) -> None:
    """The file matches its manifest entry, or a one-line error naming it and its first changed tensor (the
    tensors' byte ranges come from the manifest: a damaged header is not trusted)."""
    if not path.is_file():
        raise CompressError(f"{path} is missing (the manifest lists it): the output is damaged; re-create it")
    size, expected = path.stat().st_size, entry.get("tensors") or {}
    try:
        spans = [(int(e["offset"]), int(e["offset"]) + int(e["bytes"]), name) for name, e in expected.items()]
    except (KeyError, TypeError, ValueError):
        raise CompressError(f"the manifest entry of {path} is damaged: re-create the output") from None
    digest, tensors = _digests(path, spans)
    if digest == entry["sha256"] and size == entry["bytes"]:
        return
    for name, value in expected.items():
        if tensors[name] is None:
            raise CompressError(f"{path} is truncated ({size} of {entry['bytes']} bytes): tensor {name} is cut off; re-create the output")
        if tensors[name] != value["sha256"]:
            raise CompressError(f"{path}: tensor {name} does not match its SHA-256 in the manifest: the file is damaged; re-create the output")
    if size != entry["bytes"]:
        raise CompressError(f"{path} has {size} bytes but the manifest says {entry['bytes']}: the file is truncated or was changed; re-create the output")
    raise CompressError(f"{path} does not match its SHA-256 in the manifest (outside the tensor data): the file is damaged; re-create the output")


def _reread_gguf(path: Path) -> int:
    from compress.checkpoints.gguf_file import dequantized, mapped_tensors

    tensors = mapped_tensors(path)
    for tensor in tensors:
        dequantized(path, tensor)
    return len(tensors)


def _reread_checkpoint(path: Path, trust_remote_code: bool) -> tuple[int, int]:
    """Every tensor read (headers validated, floats finite) and every packed layer decoded."""
    from compress.checkpoints.shards import CheckpointReader, check_finite

    if not (path / "config.json").is_file():
        reader = CheckpointReader(path)
        for name in reader.names():
            reader.get(name)
        return len(reader.names()), 0
    from compress.checkpoints.model_io import open_model
    from compress.checkpoints.packed import iter_packed_layers

    handle = open_model(path, trust_remote_code)  # headers checked, and their shapes against config.json
    for name in handle.reader.names():
        handle.reader.get(name)
    layers = 0
    if getattr(handle.config, "quantization_config", None):
        for name, layer in iter_packed_layers(handle):
            check_finite(path, f"{name} (decoded)", layer.dequantized_weight())
            layers += 1
    return len(handle.reader.names()), layers


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def verify(path: Path, trust_remote_code: bool = False, progress: ProgressFn | None = None) -> VerifyResult:
    """Check the output at ``path`` (a directory, or a GGUF file with its sidecar manifest) against its
    manifest and re-read every tensor; the first damage found is a `CompressError` naming file and tensor."""
    path = Path(path)
    if not path.exists():
        raise CompressError(f"{path} does not exist: give an output directory or GGUF file")
    directory = path.is_dir()
    root = path if directory else path.parent
    files = _load_manifest(path / MANIFEST if directory else sidecar_manifest(path), path)
    if not directory and list(files) != [path.name]:
        raise CompressError(f"{sidecar_manifest(path)} describes {', '.join(files)}, not {path.name}: the file was renamed; rename it back")
    for i, (relative, entry) in enumerate(files.items()):
        _check_file(_inside(root, relative), entry)
        if progress:
            progress("checking digests", i + 1, len(files))
    if directory:
        extra = [rel for rel in _relative_files(root) if rel not in files and rel != MANIFEST]
        if extra:
            raise CompressError(f"{root / extra[0]} is not in the manifest: it was added after the output was written; remove it or re-create the output")
    if not directory:
        tensors, layers = _reread_gguf(path), 0
    elif any((path / name).is_file() for name in WEIGHT_FILES):
        tensors, layers = _reread_checkpoint(path, trust_remote_code)
    else:
        tensors, layers = 0, 0
    return VerifyResult(path, len(files), sum(e["bytes"] for e in files.values()), tensors, layers)
