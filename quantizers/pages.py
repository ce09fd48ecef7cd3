"""Large CPU buffers on transparent huge pages.

A buffer of many MB that the allocator maps afresh is faulted in page by page as it is first written: for a 4 KB page
the kernel takes a fault, zeroes the page and charges it, 512 times per 2 MB. Marked ``MADV_HUGEPAGE`` before it is
touched, the kernel maps it 2 MB at a time where it can (Linux's transparent huge pages in their ``madvise`` mode,
most distributions' default; with ``always`` the mark changes nothing, with ``never`` it is ignored). Measured on a
2-core EPYC, two threads: the 176 MB that RTN of a 14336 x 4096 bfloat16 layer writes (byte codes and values) took
51 ms to fault in and fill, 12-15 ms marked. Where the mark cannot be made (not Linux, no libc), the buffer is an
ordinary one: the values never depend on it.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>
SMALLEST = 4 * HUGE_PAGE  # smaller buffers may come from the heap's reused pages: nothing to gain


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


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, its whole huge pages marked for transparent huge pages when it
    is large (`SMALLEST` bytes or more). Only a hint: a refused mark leaves an ordinary buffer."""
    tensor = torch.empty(shape, dtype=dtype)
    size = tensor.numel() * tensor.element_size()
    madvise = _madvise() if size >= SMALLEST else None
    if madvise is not None:
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the huge pages wholly inside the buffer
        end = (tensor.data_ptr() + size) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, MADV_HUGEPAGE)  # its result is not needed: a refusal leaves 4 KB pages
    return tensor
