"""GGUF tensors encoded on worker processes: the export's encoding scales with the CPUs.

The encoders (`compress.formats.gguf.codecs.encode_tensor`) are long runs of small torch and numpy operations on
one chunk of blocks at a time. Threads of one process share the interpreter's lock, which each small operation
takes back, and gained little (Q4_K: 1.16x on 2 cores); two processes each encoding on one thread ran at 2.0x the
rate of one (Q4_K 31 MB/s each, Q6_K 60 MB/s each, on this project's 2-core machine). So a large export hands
row slices of each tensor to lanes, one per CPU it may use (at most torch's thread count, which processes sharing
a machine set), each on one thread, and puts the slices' bytes back in order. Every block lies within one row, so
the bytes are those of encoding the tensor whole. One lane is a thread of this process (its other threads only
read tensors and wait on pipes), the others are worker processes: a worker's start costs a CPU ~1.3 s of imports,
and on 2 cores the pool of two workers took that from the encoding twice (bench/gguf_encode.py, TinyLlama-shaped,
2 CPUs: Q4_K 42-44 -> 49-50 MB/s, Q6_K 65 -> 72-74 MB/s with this process as a lane).

Thread lanes: where every searched type of an export runs its search compiled (`THREAD_LANE_KINDS`, the library
built: `compress.formats.gguf.native_search`), the lanes are all threads of this process, each taking its slice's
rows straight from the tensor. The compiled search releases the interpreter's lock, so the threads share the CPUs
(a 4M-weight tensor halved between 2 threads: Q4_K 1.64-1.86x, Q6_K 1.80-2.31x, Q3_K 1.74-2.02x, Q5_K, Q2_K and the
weighted legacy types 1.55-2.23x one thread's rate), with no worker to start (1.3 s of a CPU each) and nothing copied between
processes, which had come to cost more than the faster encoding saved (TinyLlama-shaped, 2 CPUs, two processes:
Q4_K 98.6 -> 119.6 MB/s, 1.21x).

A worker is ``python -m compress.export.encoding_pool``: it reads pickled slices on its standard input and
writes their bytes (or the error) back, until its input closes. Not `multiprocessing`: its ``spawn`` reruns the
caller's main script in every worker (a script without a ``__main__`` guard then starts workers itself), and a
``fork`` of a process whose thread pools have run is unsafe. The workers start with the first slice handed out
(in parallel); below `MIN_POOL_WEIGHTS` block-quantized weights an export encodes in
its own process. Workers ignore Ctrl-C and SIGTERM: the exporting process closes their input as it unwinds (its
temporary output removed as without workers), and a worker whose parent died reads the end of its input.
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from compress.errors import CompressError
from compress.formats.gguf._common import float32_of
from compress.formats.gguf.codecs import check_shape, encode_tensor, encoding_cpus, rounds_directly
from compress.formats.gguf.grids import is_block_quantized
from compress.formats.gguf.native_search import search_library
from compress.formats.gguf.sizes import GGMLType

MIN_POOL_WEIGHTS = 1 << 25  # fewer searched weights (~1-2 s of encoding) do not repay starting the workers
MIN_SLICE_WEIGHTS = 1 << 18  # a smaller tensor is encoded in this process: handing it over costs more than it saves
MAX_SLICE_WEIGHTS = 1 << 22  # bounds the memory of the slices in flight (16 MB of float32 each)
LOOKAHEAD_WEIGHTS = 1 << 26  # an export reads tensors ahead of the one it writes up to this many weights (256 MB float32)
# types whose search runs compiled, plain and importance-weighted, and scales across threads (measured, module doc)
THREAD_LANE_KINDS = frozenset({GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
                               GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1})


def searched(kind: GGMLType, weighted: bool) -> bool:
    """True where encoding ``kind`` searches candidate grids (the k-quant and i-quant fits; the legacy types'
    importance-weighted fits): 30-100+ ns a weight here, the work worth handing to other processes. A direct rounding
    (`rounds_directly`: ~1 ns a weight) costs less than handing the weight over (a pool of 2 on Q8_0 ran at 0.51x,
    Q5_0 at 0.58x the rate of encoding here)."""
    return is_block_quantized(kind) and not rounds_directly(kind, weighted)


class _Worker:
    """One worker process and its two pipes; `call` sends one slice and waits for its bytes."""

    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "compress.export.encoding_pool"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def call(self, job: tuple) -> np.ndarray:
        try:
            pickle.dump(job, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.process.stdin.flush()
            ok, value = pickle.load(self.process.stdout)
        except (EOFError, BrokenPipeError):
            status = self.process.wait()
            raise CompressError(f"a GGUF encoding worker process ended (exit status {status}; out of memory?): "
                                "rerun with OMP_NUM_THREADS=1 to encode in this process") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self.process.stdin:
            try:
                self.process.stdin.close()  # the worker reads the end of its input and exits
            except BrokenPipeError:  # it had ended (killed): the job left in the buffer goes nowhere
                pass
        self.process.wait()


SHARED_ROWS = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SharedRows:
    """A buffer of float32 rows in an anonymous shared file (Linux's ``memfd``) that the workers map by its ``/proc``
    path: the weights are written once, as they are converted to float32, and read in place by every worker. Handing
    rows through the pipes took a 16 MB slice 21 ms there and back (0.75 GB/s), CPU time of both processes taken from
    the encoding (Q6_K encodes such a slice in ~140 ms). A buffer is reused tensor after tensor: writing 16 MB into
    fresh shared pages took 14 ms (each page allocated on first touch), into pages already there 3 ms. Where there
    is no ``memfd`` the rows go through the pipes."""

    def __init__(self, nbytes: int):
        self.capacity = nbytes
        self.fd = os.memfd_create("compress-gguf-rows")
        os.ftruncate(self.fd, nbytes)
        self.mapping = mmap.mmap(self.fd, nbytes)
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.shape = (0, 0)

    def fill(self, weight: np.ndarray) -> None:
        """Hold ``weight`` as rows ``[weight.size / cols, cols]`` (converted to float32 in the copy)."""
        self.shape = (weight.size // weight.shape[-1], weight.shape[-1])
        float32_of(weight.reshape(self.shape), out=np.ndarray(self.shape, np.float32, self.mapping))

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)


def _mapped_rows(path: str, shape: tuple[int, int], part: slice) -> tuple[np.ndarray, mmap.mmap]:
    """A worker's view of the rows ``part`` of a `SharedRows` (copy-on-write), and its mapping (closed after use)."""
    try:
        with open(path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # writable views, the file unchanged
    except OSError as exc:
        raise CompressError(f"a GGUF encoding worker cannot map the weights it was handed ({exc.strerror}): "
                            "rerun with OMP_NUM_THREADS=1 to encode in this process") from None
    return np.ndarray(shape, np.float32, mapping)[part], mapping


class Pending:
    """A tensor's bytes, being encoded: `result` waits for them (and raises a slice's error)."""

    def __init__(self, parts: int = 0, value: np.ndarray | None = None, release: Callable[[], None] | None = None):
        self.parts: list[np.ndarray | None] = [None] * parts
        self.error: BaseException | None = None
        self._release = release  # called once every part is back (the shared copy of the weights is no longer read)
        self._left = parts
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._value = value
        if value is not None or not parts:
            self._done.set()

    def finish(self, index: int, part: np.ndarray | None, error: BaseException | None = None) -> None:
        with self._lock:
            self.parts[index] = part
            self.error = self.error or error
            self._left -= 1
            if not self._left:
                if self._release is not None:
                    self._release()
                self._done.set()

    def result(self) -> np.ndarray:
        self._done.wait()
        if self.error is not None:
            raise self.error
        if self._value is None:
            self._value, self.parts = np.concatenate(self.parts), []
        return self._value


class TensorEncoder:
    """``submit(weight, kind, importance)``: `encode_tensor`'s bytes, from ``workers`` lanes (a thread here and
    ``workers - 1`` processes, or with ``threads`` all threads here) when there are more than one, as a `Pending` (so
    that the next tensor can be read while this one is encoded); ``encode`` waits for them. A context manager: leaving
    it ends the workers. While the lanes run, torch runs on one thread in this process (its lanes are CPUs of their
    own); leaving restores the count."""

    def __init__(self, workers: int = 1, threads: bool = False):
        self.workers = max(1, workers)
        self.threads = threads
        self._processes: list[_Worker] = []
        self._drivers: list[threading.Thread] = []  # one per lane: encodes slices here, or hands them to a worker
        self._todo: queue.SimpleQueue = queue.SimpleQueue()  # (pending, index, rows, kind, importance); None: stop
        self._stopping = False  # set on leaving (e.g. Ctrl-C): the slices still queued are dropped
        self._buffers: list[SharedRows] = []  # free ones (`SharedRows`): taken by a tensor, back once it is encoded
        self._threads: int | None = None  # torch's thread count before the lanes started, restored on leaving

    def __enter__(self) -> "TensorEncoder":
        return self

    def __exit__(self, *exc) -> None:
        self._stopping = True
        for _ in self._drivers:
            self._todo.put(None)
        for driver in self._drivers:
            driver.join()
        for worker in self._processes:
            worker.close()
        for buffer in self._buffers:
            buffer.close()
        self._processes, self._drivers, self._buffers = [], [], []
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def _buffer(self, nbytes: int) -> SharedRows:
        """A free buffer of at least ``nbytes`` (the smallest), or a new one."""
        fitting = [b for b in self._buffers if b.capacity >= nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.capacity)
            self._buffers.remove(buffer)
            return buffer
        return SharedRows(nbytes)

    def _drive(self, encode: Callable[[tuple], np.ndarray]) -> None:
        """Hand queued slices to ``encode`` (a worker process's `_Worker.call`, or `encode_job` here) until told to stop."""
        if encode is encode_job:  # a thread starts with OpenMP's default team, whatever the count was set to elsewhere
            torch.set_num_threads(1)
        while (item := self._todo.get()) is not None:
            pending, index, rows, kind, importance = item
            if self._stopping:
                pending.finish(index, None, CompressError("stopped"))
                continue
            try:
                pending.finish(index, encode((rows, kind, importance)))
            except Exception as exc:  # noqa: BLE001 - raised by the pending result's owner
                pending.finish(index, None, exc)

    def _slices(self, rows: int, cols: int) -> list[slice]:
        """Row slices of at most `MAX_SLICE_WEIGHTS`, at least two per worker where the tensor allows."""
        per_slice = min(MAX_SLICE_WEIGHTS, max(MIN_SLICE_WEIGHTS, rows * cols // (2 * self.workers)))
        step = max(1, per_slice // cols)
        return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]

    def submit(self, weight: np.ndarray, kind: GGMLType, importance: np.ndarray | None = None) -> Pending:
        w = np.asarray(weight)
        if self.workers == 1 or w.ndim < 2 or w.size < MIN_SLICE_WEIGHTS or not searched(kind, importance is not None):
            return Pending(value=encode_tensor(w, kind, importance))
        rows = w.reshape(-1, w.shape[-1])
        check_shape(kind, rows.shape[1])  # here, not once per slice in the workers
        shared = self._buffer(w.size * 4) if SHARED_ROWS and not self.threads else None
        if shared is not None:
            shared.fill(w)
        if not self._drivers:
            # this process is one of the lanes: torch on one thread here until the encoder is left (process-wide, set
            # from this thread before the lane's thread starts, which takes the count at its first operation)
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)
            self._processes = [] if self.threads else [_Worker() for _ in range(self.workers - 1)]
            self._drivers = [threading.Thread(target=self._drive, args=(worker.call,), daemon=True) for worker in self._processes]
            self._drivers += [threading.Thread(target=self._drive, args=(encode_job,), daemon=True)
                              for _ in range(self.workers - len(self._processes))]
            for driver in self._drivers:
                driver.start()
        slices = self._slices(*rows.shape)
        pending = Pending(len(slices), release=(lambda: self._buffers.append(shared)) if shared else None)
        for index, part in enumerate(slices):  # taken by whichever worker is free: a slow one gets fewer
            # a thread lane converts its own rows (`encode_job`); a worker process is handed float32
            source = (shared.path, shared.shape, part) if shared else rows[part] if self.threads else float32_of(rows[part])
            self._todo.put((pending, index, source, kind, importance))
        return pending

    def encode(self, weight: np.ndarray, kind: GGMLType, importance: np.ndarray | None = None) -> np.ndarray:
        return self.submit(weight, kind, importance).result()


def read_ahead(jobs: Iterable[tuple[int, Callable[[], list[Pending]]]]) -> Iterator[list[np.ndarray]]:
    """For each ``(weights, start)`` in order, the bytes of the parts ``start()`` handed to an encoder (reading a
    tensor, or an expert of it, and submitting it); the next jobs are started while the earlier ones are encoded,
    within `LOOKAHEAD_WEIGHTS` weights started and not yet yielded."""
    waiting: deque[tuple[int, list[Pending]]] = deque()
    for weights, start in jobs:
        while waiting and sum(w for w, _ in waiting) + weights > LOOKAHEAD_WEIGHTS:
            yield [part.result() for part in waiting.popleft()[1]]
        waiting.append((weights, start()))
    while waiting:
        yield [part.result() for part in waiting.popleft()[1]]


def export_encoder(shapes_and_kinds, weighted: bool) -> TensorEncoder:
    """The encoder for an export of ``(shape, kind)`` tensors (``weighted``: with an importance matrix): one lane per
    usable CPU (`encoding_cpus`), all threads of this process where every searched type's search runs compiled
    (`THREAD_LANE_KINDS`), else this process and a worker process for each other CPU when the searched encodings
    (`searched_weights`) are enough to repay starting the workers; else this process alone."""
    workers = encoding_cpus()
    kinds = {kind for _, kind in _searched(shapes_and_kinds, weighted)}
    if kinds and kinds <= THREAD_LANE_KINDS and search_library() is not None:
        return TensorEncoder(workers, threads=True)
    return TensorEncoder(workers if searched_weights(shapes_and_kinds, weighted) >= MIN_POOL_WEIGHTS else 1)


def _searched(shapes_and_kinds, weighted: bool) -> list[tuple]:
    """The ``(shape, kind)`` pairs of matrices whose encoding is a search (`searched`)."""
    return [(shape, kind) for shape, kind in shapes_and_kinds if len(shape) > 1 and searched(kind, weighted)]


def searched_weights(shapes_and_kinds, weighted: bool) -> int:
    """How many weights of ``(shape, kind)`` pairs are encoded by a search (`searched`)."""
    return sum(math.prod(shape) for shape, _ in _searched(shapes_and_kinds, weighted))


def encode_job(job: tuple) -> np.ndarray:
    """The bytes of one slice ``(rows or a SharedRows slice, kind, importance)``."""
    source, kind, importance = job
    if not isinstance(source, tuple):
        return encode_tensor(float32_of(source), kind, importance)
    rows, mapping = _mapped_rows(*source)  # a slice of a `SharedRows`
    try:
        return encode_tensor(rows, kind, importance)
    finally:
        del rows
        mapping.close()


def _serve() -> None:
    """A worker: encode each pickled ``(rows or a SharedRows slice, kind, importance)`` read from standard input, write back
    ``(True, bytes)`` or ``(False, error)``, until the input ends."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # the parent's to handle: it ends its workers as it unwinds
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not land among the replies
    jobs = sys.stdin.buffer
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        try:
            reply = (True, encode_job(job))
        except Exception as exc:  # noqa: BLE001 - handed to the parent, which raises it
            reply = (False, exc)
        try:
            pickle.dump(reply, replies, protocol=pickle.HIGHEST_PROTOCOL)
            replies.flush()
        except BrokenPipeError:  # the parent is gone (killed): nobody to answer
            return


if __name__ == "__main__":
    _serve()
