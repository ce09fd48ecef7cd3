"""GPTQ's column loop inside one lazy batch: in torch operations, or compiled (`compress.quantizers.native`).

Both run columns ``[first, last)`` of a batch held transposed (its columns are rows ``[B, out]``, contiguous): each
column is rounded on its group's grid (`round_column`), its error divided by the pivot ``U_ii`` and fed to the
batch's later columns (`feed_error_`). The compiled loop performs the same float32 operations in the same order,
one rounding each, so its results equal the torch loop's bit for bit (tests/quantizers/test_gptq_columns.py); it
splits the rows between torch's threads (each row depends on itself alone), where the torch loop runs on one.
GPTQ on SmolLM2's four layer shapes (960, 576, 3072 x 576 and 576 x 1536, act-order, w4 g64): 0.258 s in torch,
0.204-0.217 s compiled on 2 threads (the rest is the Hessian's factor, the lazy updates and the error figures); one
batch of 128 columns of 28672 rows: 39-51 ms in torch, 20 ms compiled.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from collections.abc import Iterator

import torch

from compress.quantizers.native import columns_library
from compress.quantizers.threads import even_runs, one_thread, one_thread_workers

RUNS_PER_THREAD = 4  # runs of rows per thread of a `RowSplit`, taken in turn: a thread that starts late takes fewer
MIN_ROWS = 256  # rows per thread of the compiled loop below which one thread does it all (a hand-off costs ~10 µs)


def feed_error_(later: torch.Tensor, u: torch.Tensor, err: torch.Tensor, scratch: torch.Tensor) -> None:
    """``later −= u ⊗ err`` (``later [k, rows]``, ``u [k]``, ``err [rows]``; ``scratch`` at least ``[k, rows]``): the
    column loop's error feedback, each product rounded once, then subtracted. So every weight's update is the same
    whatever the number of rows: a layer solved in row slices (on several processes) is bit for bit the layer
    solved whole. (With BLAS's rank-1 update, ``addr_``, a layer solved in row slices came out different in the last
    bits: tests/compress/engine/methods/test_row_slices.py.)"""
    products = torch.mul(u.unsqueeze(1), err, out=scratch[: u.shape[0]])
    later.sub_(products)


class TorchColumns:
    """The loop in torch operations, on any device: ~10 operations of one column each, on one thread. ``column`` None:
    no grid (SparseGPT pruning alone: a column's value is its weight, 0 where ``mask`` marks it pruned)."""

    def __init__(self, column, scale: torch.Tensor, zero: torch.Tensor):
        self.column = column  # the grid of one column (`per_column`): its `round_column`
        self.scale_rows, self.zero_rows = scale.unbind(0), zero.unbind(0)  # [n_groups, out]: views made once
        self.scratch: torch.Tensor | None = None

    def __call__(self, W1: torch.Tensor, err: torch.Tensor, U1: torch.Tensor, codes: torch.Tensor, deq: torch.Tensor,
                 groups: list[int], first: int, last: int, mask: torch.Tensor | None = None) -> None:
        """Columns ``[first, last)``; ``mask`` (bool ``[B, out]``): the pruned weights, rounded as 0 (SparseGPT)."""
        if self.scratch is None or self.scratch.shape[0] < W1.shape[0] or self.scratch.shape[1:] != W1.shape[1:]:
            self.scratch = torch.empty_like(W1)
        pivots = U1.diagonal().tolist()
        span = slice(first, last)
        masks = mask[span].unbind(0) if mask is not None else [None] * (last - first)
        # row views made once: the Python around each operation (indexing, views) costs as much as its arithmetic
        steps = zip(W1[span].unbind(0), err[span].unbind(0), codes[span].unbind(0), deq[span].unbind(0),
                    U1[span].unbind(0), groups[span], masks)
        for i, (w, e, c, d, u, g, m) in enumerate(steps, start=first):
            if self.column is None:
                d.copy_(w).masked_fill_(m, 0.0)
            else:
                self.column.round_column(w if m is None else torch.where(m, 0.0, w), self.scale_rows[g],
                                         self.zero_rows[g], c, d)
            torch.sub(w, d, out=e).div_(pivots[i])
            feed_error_(W1[i + 1 :], u[i + 1 :], e, self.scratch)


class RowSplit:
    """The rows ``[0, rows)`` cut into contiguous runs, up to `RUNS_PER_THREAD` for each of ``parts`` threads (none under
    `MIN_ROWS`): ``split(run)`` calls ``run(r0, r1)`` once for each run, this thread and ``pool``'s taking the next run
    until none is left (the compiled loops release the interpreter's lock). Taken, not dealt: a thread that starts late
    (torch's idle OpenMP thread still spinning on its core after a product, see `compress.quantizers.gguf_gptq`) takes
    fewer runs instead of holding up the others. Each row depends on itself alone: the same bits however they are cut."""

    def __init__(self, rows: int, parts: int, pool: ThreadPoolExecutor | None):
        count = parts if pool is None or parts == 1 else max(parts, min(parts * RUNS_PER_THREAD, rows // MIN_ROWS))
        self.splits = even_runs(rows, count)
        self.parts, self.pool = parts, pool

    def __call__(self, run) -> None:
        if self.pool is None or self.parts == 1:
            for split in self.splits:
                run(*split)
            return
        runs, lock = iter(self.splits), threading.Lock()

        def take() -> None:
            while True:
                with lock:
                    split = next(runs, None)
                if split is None:
                    return
                run(*split)

        helped = [self.pool.submit(take) for _ in range(self.parts - 1)]
        take()
        for done in helped:
            done.result()


def thread_parts(rows: int, threads: int) -> int:
    """Threads to share ``rows`` between: up to ``threads``, one where a thread's rows would be under `MIN_ROWS`."""
    return max(1, min(threads, rows // MIN_ROWS))


@contextmanager
def row_split(rows: int) -> Iterator[RowSplit]:
    """A `RowSplit` of ``rows`` between torch's threads (`thread_parts`)."""
    parts = thread_parts(rows, torch.get_num_threads())
    pool = ThreadPoolExecutor(parts - 1) if parts > 1 else None
    try:
        yield RowSplit(rows, parts, pool)
    finally:
        if pool is not None:
            pool.shutdown()


def check_rows(rows: int, *tensors: torch.Tensor) -> None:
    """The compiled loops read each tensor as float32 rows of ``rows`` contiguous values."""
    for t in tensors:
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != rows or not t.is_contiguous():
            raise ValueError(f"the compiled column loop needs float32 rows of {rows} contiguous values")


class CompiledColumns:
    """The loop compiled (`gptq_int_columns` of csrc/columns.c), its rows cut between threads (`RowSplit`). Integer
    grids (``bounds``; None: SparseGPT pruning alone) on the CPU; every tensor float32 with rows of ``out``
    contiguous values, a mask bool."""

    def __init__(self, library, bounds: tuple[int, int, bool] | None, scale: torch.Tensor, zero: torch.Tensor,
                 split: RowSplit):
        self.function = library.gptq_int_columns
        self.lo, self.hi, self.zero_point = bounds or (0, 0, False)
        self.quantize = bounds is not None
        self.scale, self.zero, self.split = scale, zero, split

    @property
    def splits(self) -> list[tuple[int, int]]:
        return self.split.splits

    def __call__(self, W1: torch.Tensor, err: torch.Tensor, U1: torch.Tensor, codes: torch.Tensor, deq: torch.Tensor,
                 groups: list[int], first: int, last: int, mask: torch.Tensor | None = None) -> None:
        rows = self.scale.shape[1]
        check_rows(rows, W1, err, codes, deq, self.scale, self.zero)
        if U1.stride(1) != 1:
            raise ValueError("the compiled column loop needs the factor's rows contiguous")
        if mask is not None and (mask.dtype != torch.bool or mask.shape != W1.shape or not mask.is_contiguous()):
            raise ValueError(f"the compiled column loop needs a contiguous bool mask {tuple(W1.shape)}")
        group_index = torch.tensor(groups, dtype=torch.int64)
        arguments = (W1.data_ptr(), codes.data_ptr(), deq.data_ptr(), err.data_ptr(), U1.data_ptr(), U1.stride(0),
                     self.scale.data_ptr(), self.zero.data_ptr(), group_index.data_ptr(), self.lo, self.hi,
                     int(self.zero_point), None if mask is None else mask.data_ptr(), int(self.quantize))
        self.split(lambda r0, r1: self.function(first, last, W1.shape[0], r0, r1, rows, *arguments))


@contextmanager
def column_steps(column, scale: torch.Tensor, zero: torch.Tensor, device: torch.device) -> Iterator:
    """The loop for ``column``'s grid (``scale``/``zero`` ``[n_groups, out]``, filled as the groups are fitted; None:
    SparseGPT pruning alone, ``scale`` still giving the rows): compiled where the grid has one (`code_bounds`), the
    device is the CPU and the library builds, else torch."""
    bounds = column.code_bounds() if column is not None else None
    compiled = column is None or bounds is not None
    library = columns_library() if compiled and device.type == "cpu" else None
    if library is None:
        yield TorchColumns(column, scale, zero)
        return
    with row_split(scale.shape[1]) as split:
        yield CompiledColumns(library, bounds, scale, zero, split)


class AffineColumns:
    """GPTQ's loop in a GGUF affine block grid compiled (`gguf_affine_columns` of csrc/columns.c): the columns of one
    grid block, from column ``b`` of the lazy batch ``W1t [batch, rows]``, as `compress.quantizers.gguf_gptq`'s torch
    loop runs them; ``step``/``offset``/``safe``/``codes`` ``[block, rows]``."""

    def __init__(self, library, split: RowSplit):
        self.function, self.split = library.gguf_affine_columns, split

    def __call__(self, W1t: torch.Tensor, err: torch.Tensor, U1: torch.Tensor, b: int, step: torch.Tensor,
                 offset: torch.Tensor, safe: torch.Tensor, codes: torch.Tensor, lo: float, hi: float) -> None:
        rows = W1t.shape[1]
        check_rows(rows, W1t, err, step, offset, safe, codes)
        if U1.stride(1) != 1:
            raise ValueError("the compiled column loop needs the factor's rows contiguous")
        arguments = (W1t.data_ptr(), codes.data_ptr(), err.data_ptr(), U1.data_ptr(), U1.stride(0), step.data_ptr(),
                     offset.data_ptr(), safe.data_ptr(), lo, hi)
        self.split(lambda r0, r1: self.function(b, b + step.shape[0], W1t.shape[0], r0, r1, rows, *arguments))


@contextmanager
def affine_steps(rows: int, device: torch.device) -> Iterator[AffineColumns | None]:
    """The compiled loop for GPTQ in GGUF affine grids of ``rows`` rows, or None (the torch loop): on the CPU where
    the library builds."""
    library = columns_library() if device.type == "cpu" else None
    if library is None:
        yield None
        return
    with row_split(rows) as split:
        yield AffineColumns(library, split)


@contextmanager
def lazy_update(device: torch.device) -> Iterator:
    """``update(into, a, b)``: ``into -= a @ b`` (``into [m, n]``, ``a [m, k]``), on the CPU in runs of ``into``'s rows,
    one per torch thread, each a one-thread product on a thread of ours (`RowSplit`): no OpenMP thread is left
    spinning after it (see `compress.quantizers.gguf_gptq._solve_columns`); on a GPU the plain product."""
    if device.type != "cpu":
        yield lambda into, a, b: into.addmm_(a, b, alpha=-1)
        return
    threads = torch.get_num_threads()
    with one_thread_workers(threads - 1) if threads > 1 else nullcontext() as pool:

        def update(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
            with one_thread(device):
                RowSplit(into.shape[0], thread_parts(into.shape[0], threads), pool)(lambda r0, r1: into[r0:r1].addmm_(a[r0:r1], b, alpha=-1))

        yield update
