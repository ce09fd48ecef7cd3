"""Large buffers no tensor uses any more, kept by size for the next request of their size (`compress.quantizers.pages`).

Without torch or numpy at import: the CLI's allocator policy (`compress.cli.allocator`) sets how much is kept before
anything loads torch.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


class Reuse:
    """Unused large buffers by size, up to ``limit`` bytes in all: `take` one of a size, `keep` one no tensor uses.
    The allocator's own free lists stop at its mmap threshold: above it every buffer is a fresh mapping. Thread-safe
    (buffers come back from whichever thread drops their last tensor)."""

    def __init__(self, limit: int = 0):
        self.limit, self.held = limit, 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def set_limit(self, limit: int) -> None:
        """Keep at most ``limit`` bytes from now on (those kept beyond it are let go)."""
        with self._lock:
            self.limit = limit
            if self.held > limit:
                self._free.clear()
                self.held = 0

    def take(self, size: int) -> np.ndarray | None:
        with self._lock:
            kept = self._free.get(size)
            if not kept:
                if self.held + size > self.limit:  # a new working set (a model's outer tensors after its blocks):
                    self._free.clear()  # the kept buffers would only add to its memory
                    self.held = 0
                return None
            self.held -= size
            return kept.pop()

    def keep(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self.held + buffer.nbytes <= self.limit:
                self._free.setdefault(buffer.nbytes, []).append(buffer)
                self.held += buffer.nbytes


REUSE = Reuse()  # the process's kept buffers, like the allocator's free lists; its limit is the process owner's
