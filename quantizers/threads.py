"""`one_thread()`: run a loop of small tensor operations, or a factorization, without intra-op threads;
`FixedTileProducts`, matrix products whose bits do not depend on the thread count, on `one_thread_workers`; and
`even_runs` / `share_runs`, a range cut into runs for the compiled loops' threads.

GPTQ's and SparseGPT's column loops apply ~10 operations of a few thousand elements per column. torch splits
each over its thread pool, and the fork/join per operation costs more than the arithmetic: measured on this
project's 2-core machine, GPTQ of a 576-column layer took 65 ms on one thread and 2.6 s on two with another
process busy (40x; bench/gptq_speed.py). The blocked updates between the loops are real matrix products and
keep every thread.

The Hessian's factorization runs its diagonal blocks on one thread (`compress.quantizers.hessian_factor`): MKL's
float32 Cholesky rounds differently with 1 and 2 threads, and GPTQ's codes then differed between machines of
different core counts (8 of 12 random layers did). Its products between the blocks go through `FixedTileProducts`:
MKL's threaded product splits the output by rows and columns, not the sum, but the edges of each thread's share
run other micro-kernels, which sum in another order, so on some CPUs the bits still moved with the thread count
(an AMD EPYC with AVX-512: a [37, 128] × [128, 37] product differed between 1 and 3 threads, [5, 128] × [128, 16]
between 1 and 2). ``torch.set_num_threads`` is process-wide, so the previous count is restored on exit; the solvers
are not run concurrently from several threads of one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Intra-op parallelism off inside the block (CPU only; a GPU's kernels are unaffected)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# A tile of `FixedTileProducts`: large enough that one thread runs it at full speed (a [128, 128] x [128, 1024]
# product is ~34 MFLOP), small enough that a product of a few thousand rows has tiles for every thread.
TILE_ROWS, TILE_COLUMNS = 128, 1024
# multiply-adds below which handing tiles to other threads costs more than it saves: the helper's tiles wait on the
# interpreter's lock (the Hessian factor of a 576-wide layer, 2 threads: 7.8 ms at 2^23, 4.6-5.4 ms at 2^25, 1 thread
# 5.0-5.7 ms; 1024 to 3072 wide alike within noise)
SMALL_PRODUCT = 1 << 25


def one_thread_workers(count: int) -> ThreadPoolExecutor:
    """A pool of ``count`` threads whose torch operations run on one thread each. A new thread starts with OpenMP's
    default team (every core), whatever ``torch.set_num_threads`` said in the thread that made it, so without this
    each worker's operations would fork onto every core again (measured on the factor's products: 2 workers ran no
    faster than 1)."""
    return ThreadPoolExecutor(max_workers=max(1, count), initializer=torch.set_num_threads, initargs=(1,))


def even_runs(count: int, parts: int) -> list[tuple[int, int]]:
    """``[0, count)`` cut into ``parts`` contiguous runs ``(start, stop)`` whose lengths differ by at most one."""
    return [(i * count // parts, (i + 1) * count // parts) for i in range(parts)]


def share_runs(pool: ThreadPoolExecutor | None, run, runs: list[tuple[int, int]]) -> list:
    """``run(a, b)`` for each of ``runs``: the first on this thread, the others on ``pool``'s (compiled loops that
    release the interpreter's lock); their results in the runs' order. No more runs than the pool's threads and this
    one, and one where there is no pool."""
    helped = [pool.submit(run, a, b) for a, b in runs[1:]]
    first = run(*runs[0])
    return [first, *(done.result() for done in helped)]


class FixedTileProducts:
    """Matrix products with the same bits whatever the thread count, still using the threads.

    ``with FixedTileProducts(device) as product: c = product(a, b)``: ``a @ b`` (``[m, k] @ [k, n]``) with the output
    cut into tiles of `TILE_ROWS` x `TILE_COLUMNS` that depend on the shapes alone, each tile one product on one
    thread; a large product's tiles are shared, in runs of consecutive tiles, between this thread and helper threads
    (`one_thread_workers`, as many as torch's thread count less one), started at the first such product. Inside, torch runs on one thread
    (`one_thread`: it must not split a tile again, and switching its thread count per product costs more than a
    small product), so ``product(a, b, into=t)`` and ``product(a, b, into=t, subtract=True)`` write or subtract the
    product into ``t`` tile by tile on the same threads. On a GPU it is the plain product."""

    def __init__(self, device: torch.device):
        self.device = device
        self.workers = torch.get_num_threads() if device.type == "cpu" else 1
        self._pool: ThreadPoolExecutor | None = None
        self._one_thread = one_thread(device)

    def __enter__(self) -> "FixedTileProducts":
        self._one_thread.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._one_thread.__exit__(*exc)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, into: torch.Tensor | None = None, subtract: bool = False) -> torch.Tensor:
        if self.device.type != "cpu":
            if into is None:
                return a @ b
            return into.sub_(a @ b) if subtract else into.copy_(a @ b)
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.result_type(a, b), device=a.device) if into is None else into
        tiles = [(slice(r, r + TILE_ROWS), slice(c, c + TILE_COLUMNS))
                 for r in range(0, a.shape[0], TILE_ROWS) for c in range(0, b.shape[1], TILE_COLUMNS)]

        def run(part: list[tuple[slice, slice]]) -> None:
            for rows, columns in part:
                if subtract:
                    out[rows, columns] -= a[rows] @ b[:, columns]
                else:
                    torch.matmul(a[rows], b[:, columns], out=out[rows, columns])

        workers = min(self.workers, len(tiles))
        if workers == 1 or a.shape[0] * a.shape[1] * b.shape[1] < SMALL_PRODUCT:
            run(tiles)
            return out
        if self._pool is None:
            self._pool = one_thread_workers(self.workers - 1)
        share = -(-len(tiles) // workers)
        helped = [self._pool.submit(run, tiles[i : i + share]) for i in range(share, len(tiles), share)]
        run(tiles[:share])
        for done in helped:
            done.result()
        return out
