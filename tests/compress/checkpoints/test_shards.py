"""Tests for compress.checkpoints.shards: lazy CheckpointReader and streamed ShardedWriter."""

from __future__ import annotations

import json
import os
import re
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compress.checkpoints.shards import SAFE_INDEX, SAFE_SINGLE, CheckpointReader, ShardedWriter, write_safetensors
from references import one_line_error
from conftest import save_random_model, tiny_llama_config




def _assert_reader_matches(reader: CheckpointReader, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(reader.names()) == sorted(expected)
    for name, tensor in expected.items():
        assert name in reader
        got = reader.get(name)
        assert got.dtype == tensor.dtype, name
        assert got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


class _NotATensor:
    """A pickled class instance: weights_only=True must refuse it."""

    def __init__(self):
        self.value = 3


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory) -> Path:
    return save_random_model(tiny_llama_config(), tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(out, max_shard_size="50KB")
    return out


def _copy_single(src: Path, dst: Path) -> Path:
    dst.mkdir()
    (dst / SAFE_SINGLE).write_bytes((src / SAFE_SINGLE).read_bytes())
    return dst / SAFE_SINGLE


# -- reading --------------------------------------------------------------------------------------


def test_reader_single_safetensors(single_dir):
    expected = load_file(str(single_dir / SAFE_SINGLE))
    reader = CheckpointReader(single_dir)
    assert reader.files == [single_dir / SAFE_SINGLE]
    _assert_reader_matches(reader, expected)
    assert reader.total_bytes() == (single_dir / SAFE_SINGLE).stat().st_size


def test_reader_single_matches_model_state_dict(single_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # same seed as save_random_model
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    reader = CheckpointReader(single_dir)
    state = model.state_dict()
    assert sorted(reader.names()) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(reader.get(name), tensor), name


def test_reader_sharded_safetensors(sharded_dir):
    index = json.loads((sharded_dir / SAFE_INDEX).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1, "the fixture should produce a sharded checkpoint"
    assert not (sharded_dir / SAFE_SINGLE).exists()
    expected = {}
    for f in shard_files:
        expected.update(load_file(str(sharded_dir / f)))
    assert sorted(expected) == sorted(index["weight_map"])
    reader = CheckpointReader(sharded_dir)
    assert sorted(p.name for p in reader.files) == shard_files
    _assert_reader_matches(reader, expected)


def test_reader_pytorch_bin(tmp_path):
    torch.manual_seed(0)
    state = {
        "a.weight": torch.randn(8, 4),
        "a.bias": torch.randn(8),
        "b.weight": torch.randn(3, 5).to(torch.bfloat16),
        "steps": torch.arange(6, dtype=torch.int64),
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    reader = CheckpointReader(tmp_path)
    _assert_reader_matches(reader, state)


def test_reader_prefers_safetensors_over_bin(single_dir, tmp_path):
    _copy_single(single_dir, tmp_path / "both")
    torch.save({"other": torch.zeros(2)}, tmp_path / "both" / "pytorch_model.bin")
    reader = CheckpointReader(tmp_path / "both")
    assert "other" not in reader
    assert [p.name for p in reader.files] == [SAFE_SINGLE]


def _resident_pages(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the OS's page cache, pages in all), by mincore(2) on a mapping of the file."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with path.open("rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    if address in (None, ctypes.c_void_p(-1).value):
        pytest.skip("mmap failed")
    try:
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(address, size, vec) != 0:
            pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
        return sum(v & 1 for v in vec), pages
    finally:
        libc.munmap(address, size)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise")
def test_prefetch_brings_the_named_tensors_into_the_page_cache(tmp_path):
    """After `prefetch` the tensors' pages are in the OS's page cache (mincore says so), dropped from it first; a name
    not stored is passed over, and the tensors read back unchanged."""
    tensors = {"a": torch.randn(256, 1024), "b": torch.randn(512, 1024)}
    path = tmp_path / SAFE_SINGLE
    write_safetensors(path, tensors)
    with path.open("rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    resident, pages = _resident_pages(path)
    if resident > pages // 4:
        pytest.skip(f"this file system keeps the file in memory ({resident} of {pages} pages after DONTNEED)")
    reader = CheckpointReader(tmp_path)
    assert reader.prefetch(["not stored"]) is None
    thread = reader.prefetch(["b", "a", "not stored"])
    thread.join(timeout=30)
    deadline = time.monotonic() + 30  # the advice starts the reads; the disk finishes them
    while _resident_pages(path)[0] < pages - 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident_pages(path)[0] >= pages - 2  # every page but perhaps the header's
    _assert_reader_matches(reader, tensors)


def test_truncated_data_is_an_error(single_dir, tmp_path):
    path = _copy_single(single_dir, tmp_path / "cut")
    data = path.read_bytes()
    path.write_bytes(data[:-17])
    msg = one_line_error(CheckpointReader, tmp_path / "cut")
    assert str(path) in msg
    assert "truncated" in msg


def test_truncated_inside_header_is_an_error(single_dir, tmp_path):
    path = _copy_single(single_dir, tmp_path / "cut-header")
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[: 8 + header_len // 2])
    msg = one_line_error(CheckpointReader, tmp_path / "cut-header")
    assert str(path) in msg
    assert "truncated" in msg


def test_three_byte_file_is_not_safetensors(tmp_path):
    (tmp_path / SAFE_SINGLE).write_bytes(b"abc")
    msg = one_line_error(CheckpointReader, tmp_path)
    assert str(tmp_path / SAFE_SINGLE) in msg
    assert "not a safetensors file" in msg


def test_empty_file_is_not_safetensors(tmp_path):
    (tmp_path / SAFE_SINGLE).write_bytes(b"")
    msg = one_line_error(CheckpointReader, tmp_path)
    assert str(tmp_path / SAFE_SINGLE) in msg
    assert "not a safetensors file" in msg


def test_corrupt_header_json_is_an_error(tmp_path):
    header = b"{not json" + b" " * 7
    (tmp_path / SAFE_SINGLE).write_bytes(struct.pack("<Q", len(header)) + header)
    msg = one_line_error(CheckpointReader, tmp_path)
    assert str(tmp_path / SAFE_SINGLE) in msg
    assert "corrupt" in msg


def test_header_json_not_an_object_is_an_error(tmp_path):
    header = b"[1, 2, 3]       "
    (tmp_path / SAFE_SINGLE).write_bytes(struct.pack("<Q", len(header)) + header)
    one_line_error(CheckpointReader, tmp_path)


def test_index_with_missing_shard(sharded_dir, tmp_path):
    index = json.loads((sharded_dir / SAFE_INDEX).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / SAFE_INDEX).write_text(json.dumps(index))
    for f in shard_files[:-1]:  # leave out the last shard
        (broken / f).write_bytes((sharded_dir / f).read_bytes())
    msg = one_line_error(CheckpointReader, broken)
    assert shard_files[-1] in msg
    assert "missing" in msg


def test_index_without_weight_map(tmp_path):
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"metadata": {}}))
    msg = one_line_error(CheckpointReader, tmp_path)
    assert SAFE_INDEX in msg


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    msg = one_line_error(CheckpointReader, tmp_path)
    assert "no weights" in msg
    assert str(tmp_path) in msg


def test_bin_with_pickled_object_is_refused(tmp_path):
    torch.save({"w": torch.zeros(2), "obj": _NotATensor()}, tmp_path / "pytorch_model.bin")
    msg = one_line_error(CheckpointReader, tmp_path)
    assert "weights_only" in msg
    assert str(tmp_path / "pytorch_model.bin") in msg


def test_bin_that_is_not_a_pickle(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"definitely not a torch file")
    one_line_error(CheckpointReader, tmp_path)


# -- writing --------------------------------------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.w": torch.randn(16, 8, generator=g),  # 512 bytes
        "layers.0.b": torch.randn(16, generator=g),  # 64 bytes
        "layers.1.w": torch.randn(16, 8, generator=g).to(torch.bfloat16),  # 256 bytes
        "layers.1.h": torch.randn(4, 8, generator=g).to(torch.float16),  # 64 bytes
        "layers.2.w": torch.randn(32, 8, generator=g),  # 1024 bytes
        "ids": torch.arange(10, dtype=torch.int32),  # 40 bytes
    }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_writer_several_shards_and_index(tmp_path):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path, max_shard_bytes=300)
    for name, t in tensors.items():
        writer.add(name, t)
    finals = writer.close()
    n = len(finals)
    assert n > 1
    assert [p.name for p in finals] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    on_disk = sorted(p.name for p in tmp_path.iterdir())
    assert on_disk == sorted([p.name for p in finals] + [SAFE_INDEX])  # no leftover temp files
    assert not (tmp_path / SAFE_SINGLE).exists()

    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert set(index["weight_map"].values()) == {p.name for p in finals}
    total = sum(_nbytes(t) for t in tensors.values())
    assert index["metadata"]["total_size"] == total
    assert writer.total_bytes == total

    loaded = {}
    for p in finals:
        part = load_file(str(p))
        for name in part:
            assert index["weight_map"][name] == p.name
        loaded.update(part)
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype, name
        assert torch.equal(loaded[name], t), name

    # And the reader reads the writer's output back.
    _assert_reader_matches(CheckpointReader(tmp_path), tensors)


def test_writer_single_shard(tmp_path):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path, max_shard_bytes=1 << 20)
    for name, t in tensors.items():
        writer.add(name, t)
    finals = writer.close()
    assert finals == [tmp_path / SAFE_SINGLE]
    assert not (tmp_path / SAFE_INDEX).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [SAFE_SINGLE]
    loaded = load_file(str(tmp_path / SAFE_SINGLE))
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype, name
        assert torch.equal(loaded[name], t), name
    assert writer.total_bytes == sum(_nbytes(t) for t in tensors.values())


def test_shards_are_written_in_place_and_a_full_header_room_starts_the_next_shard(tmp_path):
    """Each shard's header sits in the room reserved before its data (padded with spaces, which the safetensors
    library reads); 300 small tensors in one 1 MB shard's 4 KB room: the header would outgrow it, so the writer
    finishes shards early, each with its room filled no further than it fits."""
    writer = ShardedWriter(tmp_path, max_shard_bytes=1 << 20)
    assert writer.header_room == 4096
    tensors = {f"model.layers.{i}.mlp.weight_scale": torch.full((3,), float(i)) for i in range(300)}
    for name, t in tensors.items():
        writer.add(name, t)
        assert [p.suffix for p in tmp_path.iterdir()] == [".tmp"] * len(list(tmp_path.iterdir()))  # no side files
    finals = writer.close()
    assert len(finals) > 1
    loaded = {}
    for path in finals:
        raw = path.read_bytes()
        assert int.from_bytes(raw[:8], "little") == 4096 - 8 and raw[8:4096].rstrip(b" ").endswith(b"}")
        assert len(raw) == 4096 + 12 * len(load_file(str(path)))
        loaded.update(load_file(str(path)))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_writer_non_contiguous_input(tmp_path):
    base = torch.randn(8, 6)
    view = base.t()  # non-contiguous
    writer = ShardedWriter(tmp_path)
    writer.add("t", view)
    writer.close()
    loaded = load_file(str(tmp_path / SAFE_SINGLE))
    assert torch.equal(loaded["t"], view)


def test_writer_shard_names_are_five_digit(tmp_path):
    writer = ShardedWriter(tmp_path, max_shard_bytes=1)
    for i in range(3):
        writer.add(f"t{i}", torch.full((2,), float(i)))
    finals = writer.close()
    assert [p.name for p in finals] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for p in finals:
        assert re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", p.name)
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    assert index["weight_map"] == {f"t{i}": finals[i].name for i in range(3)}
    assert index["metadata"]["total_size"] == 3 * 2 * 4


def test_write_safetensors_is_read_by_the_safetensors_library(tmp_path):
    from safetensors import safe_open

    from compress.checkpoints.shards import write_safetensors

    tensors = {
        "b": torch.randn(3, 5, dtype=torch.bfloat16),
        "a": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "view": torch.randn(6, 4).t(),  # non-contiguous input
    }
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0


# -- resuming a killed writer (state / restore) --------------------------------------------------------
def _resume_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {f"t{i}": torch.randn(40 + i, generator=gen).to(torch.bfloat16 if i % 3 == 0 else torch.float32) for i in range(12)}


def _uninterrupted(tmp_path: Path, tensors: dict, limit: int) -> tuple[Path, Path]:
    """``whole``: every tensor written by one writer; ``killed``: an empty folder for the interrupted one."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    writer = ShardedWriter(whole, limit)
    for name, t in tensors.items():
        writer.add(name, t)
    writer.close()
    return whole, killed


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("cut", [1, 4, 7, 11])
def test_a_restored_writer_finishes_with_the_bytes_of_an_uninterrupted_one(tmp_path, cut):
    """Killed after ``cut`` tensors (its state recorded), with more tensors written after the record: a new
    writer restored from the record writes the rest, and every file equals an uninterrupted writer's. Shards of
    ~3 tensors, so records fall inside a shard, at its end and after a finished one."""
    tensors, limit = _resume_tensors(), 3 * 45 * 4
    whole, killed = _uninterrupted(tmp_path, tensors, limit)
    writer, names = ShardedWriter(killed, limit), list(tensors)
    for name in names[:cut]:
        writer.add(name, tensors[name])
    state = json.loads(json.dumps(writer.state()))  # as the progress record stores it
    for name in names[cut:cut + 4]:  # work after the record, lost with the process
        writer.add(name, tensors[name])
    del writer
    resumed = ShardedWriter(killed, limit)
    resumed.restore(state)
    for name in names[cut:]:
        resumed.add(name, tensors[name])
    resumed.close()
    assert _files(killed) == _files(whole)
    reread = CheckpointReader(killed)
    assert all(torch.equal(reread.get(n), t) for n, t in tensors.items())


def test_a_writer_killed_while_finishing_a_shard_is_restored(tmp_path):
    """Killed after `flush` wrote the shard's header, before the next record: the shard is cut back to the
    recorded data and finished again."""
    tensors, limit = _resume_tensors(), 10_000
    whole, killed = _uninterrupted(tmp_path, tensors, limit)
    writer, names = ShardedWriter(killed, limit), list(tensors)
    for name in names[:5]:
        writer.add(name, tensors[name])
    state = writer.state()
    writer.add(names[5], tensors[names[5]])
    writer.flush()  # the shard is finished: its header written into the room before its data
    assert sorted(p.name for p in killed.iterdir()) == ["shard-00000.tmp"]
    resumed = ShardedWriter(killed, limit)
    resumed.restore(state)
    for name in names[5:]:
        resumed.add(name, tensors[name])
    resumed.close()
    assert _files(killed) == _files(whole)


def test_a_record_naming_a_missing_shard_is_one_line(tmp_path):
    writer = ShardedWriter(tmp_path, 100)
    writer.add("a", torch.zeros(64))
    state = writer.state()
    (tmp_path / "shard-00000.tmp").unlink()
    message = one_line_error(ShardedWriter(tmp_path, 100).restore, state)
    assert "shard-00000.tmp" in message and "remove it" in message


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_failed_write_on_the_writing_thread_is_raised_by_the_writer(tmp_path, monkeypatch):
    """The writes run on a thread of their own: a full disk (/dev/full: every write fails with ENOSPC) is raised from a
    later call of the writer itself, not lost on that thread."""
    writer = ShardedWriter(tmp_path, max_shard_bytes=1 << 20)
    monkeypatch.setattr(ShardedWriter, "_shard_path", lambda self: Path("/dev/full"))
    writer.add("a", torch.randn(64, 64))
    with pytest.raises(OSError) as failed:
        writer.close()
    assert failed.value.errno == 28  # ENOSPC
