"""`one_thread()`: run a loop of small tensor operations, or a factorization, without intra-op threads.

GPTQ's and SparseGPT's column loops apply ~10 operations of a few thousand elements per column. torch splits
each over its thread pool, and the fork/join per operation costs more than the arithmetic: measured on this
project's 2-core machine, GPTQ of a 576-column layer took 65 ms on one thread and 2.6 s on two with another
process busy (40x; bench/gptq_speed.py). The blocked updates between the loops are real matrix products and
keep every thread.

The Hessian's factorization runs its diagonal blocks on one thread (`compress.quantizers.hessian_factor`): MKL's
float32 Cholesky rounds differently with 1 and 2 threads, and GPTQ's codes then differed between machines of
different core counts (8 of 12 random layers did); the products between the blocks split rows and columns, not
the sum, so they keep every thread and agree. ``torch.set_num_threads`` is process-wide, so the previous count is
restored on exit; the solvers are not run concurrently from several threads of one process.
"""

from __future__ import annotations

from collections.abc import Iterator
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
