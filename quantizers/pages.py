"""Large CPU buffers on transparent huge pages.

A buffer of many MB that the allocator maps afresh is faulted in page by page as it is first written: for a 4 KB page
the kernel takes a fault, zeroes the page and charges it, 512 times per 2 MB. Marked ``MADV_HUGEPAGE`` before it is
touched, the kernel maps it 2 MB at a time where it can (Linux's transparent huge pages in their ``madvise`` mode,
most distributions' default; with ``always`` the mark changes nothing, with ``never`` it is ignored). Measured on a
2-core EPYC, two threads: the 176 MB that RTN of a 14336 x 4096 bfloat16 layer writes (byte codes and values) took
51 ms to fault in and fill, 12-15 ms marked. Where the mark cannot be made (not Linux, no libc), the buffer is an
ordinary one: the values never depend on it.

A large buffer, once every tensor on it is gone, is kept (`Reuse`) and handed to the next request of its size instead
of a fresh mapping: the kernel zeroes every page it maps, huge or not, and a model's layers ask for the same few sizes
block after block (RTN of an 8B-shaped model: 8 GB of byte codes, 16 GB of read weights). How much is kept is the
process owner's setting, as the allocator's are (the CLI's policy, `compress.cli.allocator`): none unless set, since
kept buffers serve only their own size, where a heap that keeps freed memory serves every request (GPTQ on the 8B
shapes, whose heap keeps 512 MB: peak RSS 9.09 GB with 1 GiB kept here, 8.85-8.95 GB with none). What a caller gets
holds whatever was last written there, as `torch.empty`'s may.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import weakref

import numpy as np
import torch

from compress.quantizers.reuse import REUSE, Reuse

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>
SMALLEST = 4 * HUGE_PAGE  # smaller buffers may come from the heap's reused pages: nothing to gain
ALIGN = 64  # torch.empty's alignment


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, reuse: Reuse = REUSE) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU. A large one (`SMALLEST` bytes or more) is a buffer of that size
    no tensor uses any more, where ``reuse`` keeps one, else a new one with its whole huge pages marked for transparent
    huge pages (only a hint: a refused mark leaves an ordinary buffer); it goes back to ``reuse`` once every tensor
    on it is gone."""
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size < SMALLEST:
        return torch.empty(shape, dtype=dtype)
    buffer = reuse.take(size)
    if buffer is None:
        whole = np.empty(size + ALIGN, np.uint8)
        skip = -whole.ctypes.data % ALIGN  # aligned as torch's own buffers are
        buffer = whole[skip : skip + size]
        _mark(buffer.ctypes.data, size)
    handle = buffer.view()  # the tensor's own array: it lives as long as any tensor on the buffer (`torch.from_numpy`)
    finalizer = weakref.finalize(handle, reuse.keep, buffer)
    finalizer.atexit = False
    return torch.from_numpy(handle).view(dtype).view(shape)


def _mark(begin: int, size: int) -> None:
    """Mark the huge pages wholly inside ``[begin, begin + size)``."""
    madvise = _madvise()
    if madvise is None:
        return
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    end = (begin + size) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        madvise(start, end - start, MADV_HUGEPAGE)  # its result is not needed: a refusal leaves 4 KB pages
