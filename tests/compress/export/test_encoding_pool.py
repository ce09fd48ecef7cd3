"""GGUF encoding on worker processes: the bytes are `encode_tensor`'s (itself checked against ggml's quantizer in
tests/formats/gguf/test_ggml_reference.py), whatever the slicing; errors come back as one line."""

from __future__ import annotations

import numpy as np
import pytest

from compress.errors import CompressError
from compress.export import encoding_pool
from compress.export.encoding_pool import TensorEncoder, searched, searched_weights
from compress.formats.gguf.codecs import encode_tensor
from compress.formats.gguf.sizes import GGMLType


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of a few rows, so that a small tensor is cut into many, handed out to both workers in turn."""
    monkeypatch.setattr(encoding_pool, "MIN_SLICE_WEIGHTS", 1 << 10)
    monkeypatch.setattr(encoding_pool, "MAX_SLICE_WEIGHTS", 1 << 12)


def weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)


def test_workers_write_the_bytes_of_one_process(small_slices):
    w = weights(37, 512)  # 37 rows: the last slice is short
    importance = np.random.default_rng(1).gamma(0.5, 2.0, 512).astype(np.float32)
    stacked = weights(3 * 8, 256, seed=2).reshape(3, 8, 256)  # experts: rows across the leading axes
    with TensorEncoder(2) as encoder:
        assert [s.stop - s.start for s in encoder._slices(37, 512)] == [8, 8, 8, 8, 5]
        for kind in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.IQ4_XS):
            assert np.array_equal(encoder.encode(w, kind), encode_tensor(w, kind)), kind
            assert np.array_equal(encoder.encode(w, kind, importance), encode_tensor(w, kind, importance)), kind
        assert np.array_equal(encoder.encode(stacked, GGMLType.Q3_K), encode_tensor(stacked, GGMLType.Q3_K))
        assert len(encoder._processes) == 1  # started once, reused by every tensor; this process is the other lane


def test_thread_lanes_write_the_bytes_of_one_lane_on_one_torch_thread_each(small_slices, monkeypatch):
    import threading

    import torch

    seen = []
    monkeypatch.setattr(encoding_pool, "encode_job", lambda job, encode=encoding_pool.encode_job: (seen.append((threading.get_ident(), torch.get_num_threads())), encode(job))[1])
    w = weights(37, 512).astype(np.float16)  # as an export hands them over: each lane makes its rows float32
    importance = np.random.default_rng(1).gamma(0.5, 2.0, 512).astype(np.float32)
    with TensorEncoder(2, threads=True) as encoder:
        for kind in (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_0):
            assert np.array_equal(encoder.encode(w, kind), encode_tensor(w.astype(np.float32), kind)), kind
            assert np.array_equal(encoder.encode(w, kind, importance), encode_tensor(w.astype(np.float32), kind, importance)), kind
        assert not encoder._processes and len(encoder._drivers) == 2
    assert seen and {count for _, count in seen} == {1}


def test_this_process_is_a_lane_on_one_thread_until_the_encoder_is_left(small_slices, monkeypatch):
    """With 2 lanes, one worker process and a thread here share the slices; that thread's torch operations run on one
    thread (else they would split over the CPUs the worker uses), and leaving restores the process's thread count."""
    import torch

    here = []
    monkeypatch.setattr(encoding_pool, "encode_job", lambda job, encode=encoding_pool.encode_job: (here.append(torch.get_num_threads()), encode(job))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = weights(64, 256)
        with TensorEncoder(2) as encoder:
            assert np.array_equal(encoder.encode(w, GGMLType.Q4_K), encode_tensor(w, GGMLType.Q4_K))
            assert len(encoder._processes) == 1
        assert here and set(here) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_encoder_error_comes_back_as_itself(small_slices):
    with TensorEncoder(2) as encoder, pytest.raises(CompressError, match="needs an importance matrix"):
        encoder.encode(weights(16, 256), GGMLType.IQ2_XXS)  # checked in the worker, raised here
    with TensorEncoder(2) as encoder, pytest.raises(CompressError, match="cannot be stored as Q4_K"):
        encoder.encode(weights(1024, 96), GGMLType.Q4_K)


def test_a_worker_that_died_is_a_one_line_error(small_slices, monkeypatch):
    import threading

    w = weights(64, 256)
    # once the worker is killed, this process's lane waits for the worker's lane to fail, so that slices reach the
    # dead worker whatever the scheduling (else this lane could take every slice first)
    open_, real_call = threading.Event(), encoding_pool._Worker.call
    open_.set()

    def call(self, job):
        try:
            return real_call(self, job)
        except CompressError:
            open_.set()
            raise

    monkeypatch.setattr(encoding_pool._Worker, "call", call)
    monkeypatch.setattr(encoding_pool, "encode_job", lambda job, encode=encoding_pool.encode_job: (open_.wait(60), encode(job))[1])
    with TensorEncoder(2) as encoder:
        encoder.encode(w, GGMLType.Q4_K)
        open_.clear()
        encoder._processes[0].process.kill()
        with pytest.raises(CompressError, match=r"worker process ended \(exit status -9.*OMP_NUM_THREADS=1"):
            encoder.encode(w, GGMLType.Q4_K)


def test_direct_roundings_stay_in_this_process():
    """Q8_0 and the legacy types' plain rounding cost less than handing the weights over; with an importance matrix
    the legacy types search (ggml's weighted fits), Q8_0 ignores it."""
    assert not searched(GGMLType.Q8_0, False) and not searched(GGMLType.Q8_0, True)
    for kind in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        assert not searched(kind, False) and searched(kind, True), kind
    assert searched(GGMLType.Q4_K, False) and searched(GGMLType.IQ4_NL, False)
    assert not searched(GGMLType.F16, False)
    assert searched_weights([((8, 256), GGMLType.Q6_K), ((256,), GGMLType.Q6_K), ((8, 256), GGMLType.Q8_0)], False) == 2048
    with TensorEncoder(2) as encoder:
        encoder.encode(weights(2048, 256), GGMLType.Q8_0)
        assert not encoder._processes


@pytest.mark.parametrize("compiled", [False, True], ids=["worker processes", "thread lanes"])
def test_an_export_on_lanes_writes_the_same_tensors(tmp_path, monkeypatch, small_slices, compiled):
    """Q4_K_M's types (Q4_K, Q6_K) search compiled: its lanes are threads of this process; with the compiled searches
    off (``COMPRESS_NATIVE=0``) this process and a worker process. Either way, the bytes of one lane."""
    from compress.checkpoints.gguf_file import mapped_tensors
    from compress.export.gguf import ExportConfig, export_gguf
    from compress.formats.gguf.native_search import search_library
    from compress.formats.gguf.plan import Target
    from conftest import REFERENCE_MODEL

    def tensors(path):
        return {t.name: bytes(np.asarray(t.data).view(np.uint8)) for t in mapped_tensors(path)}

    if compiled and search_library() is None:
        pytest.skip("no C compiler: the compiled searches are not built")
    monkeypatch.setenv("COMPRESS_NATIVE", "1" if compiled else "0")
    started, encoders = [], []
    monkeypatch.setattr(encoding_pool, "encoding_cpus", lambda: 2)
    monkeypatch.setattr(encoding_pool._Worker, "__init__", lambda self, start=encoding_pool._Worker.__init__: (started.append(1), start(self))[1])
    monkeypatch.setattr(encoding_pool, "TensorEncoder", lambda *a, make=encoding_pool.TensorEncoder, **k: encoders.append(make(*a, **k)) or encoders[-1])
    monkeypatch.setattr(encoding_pool, "MIN_POOL_WEIGHTS", 1 << 40)
    export_gguf(ExportConfig(REFERENCE_MODEL, tmp_path / "here.gguf", Target("q4_k_m")))
    assert not started
    assert encoders[-1].workers == (2 if compiled else 1) and encoders[-1].threads == compiled  # threads start nothing
    monkeypatch.setattr(encoding_pool, "MIN_POOL_WEIGHTS", 0)
    export_gguf(ExportConfig(REFERENCE_MODEL, tmp_path / "lanes.gguf", Target("q4_k_m")))
    assert len(started) == (0 if compiled else 1)  # and this process
    assert encoders[-1].workers == 2 and encoders[-1].threads == compiled
    assert tensors(tmp_path / "lanes.gguf") == tensors(tmp_path / "here.gguf")


def test_leaving_early_drops_the_queued_slices_and_ends_the_workers(small_slices, monkeypatch):
    """Ctrl-C or SIGTERM unwinds through the encoder: the slices still queued are not encoded (the export stops
    within a slice, not after the whole tensor), and no worker process is left behind."""
    import time

    # this process's lane at 20 ms a slice: on a fast CPU it could otherwise encode dozens of these small slices
    # before the interrupt reaches the encoder (a thread switch is 5 ms)
    monkeypatch.setattr(encoding_pool, "encode_job", lambda job, encode=encoding_pool.encode_job: (time.sleep(0.02), encode(job))[1])
    with pytest.raises(KeyboardInterrupt):
        with TensorEncoder(2) as encoder:
            pending = encoder.submit(weights(4096, 256), GGMLType.Q4_K)  # 256 slices of 16 rows
            workers = [w.process for w in encoder._processes]
            raise KeyboardInterrupt
    assert all(process.poll() is not None for process in workers)
    with pytest.raises(CompressError, match="stopped"):
        pending.result()
    assert sum(part is not None for part in pending.parts) < 16  # at most what was in flight when it stopped
