"""This disk's sequential bandwidth, measured with ``dd`` on the very files a run reads and as many bytes as it writes,
and what share of it a run used: the yardstick of a data-free run (RTN reads a checkpoint and writes its output, and
can go no faster than the disk).

- `evict` drops files from the OS's page cache (``posix_fadvise`` DONTNEED after a flush: no root needed), so that the
  next read of them comes from the disk, as a user's first run does.
- `measure` reads the files with ``dd bs=16M`` (evicted first) and writes the same number of bytes as the run's output
  with ``dd bs=16M conv=fdatasync`` (the write counted until it is on the disk), each timed as a whole process.
- `share`: the disk's own time for the run's bytes (read at the read bandwidth, written at the write bandwidth) over the
  run's wall time: 1.0 is a run that moves its bytes as fast as ``dd`` does, doing nothing else.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DD_BLOCK = "16M"


def evict(paths: list[Path]) -> None:
    """Have the OS drop these files' pages from its cache (written pages are flushed first, as DONTNEED drops only clean
    ones)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def size_of(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


@dataclass(frozen=True)
class Disk:
    read_bytes: int
    read_seconds: float
    write_bytes: int
    write_seconds: float

    @property
    def read_rate(self) -> float:
        return self.read_bytes / self.read_seconds

    @property
    def write_rate(self) -> float:
        return self.write_bytes / self.write_seconds

    def seconds_for(self, read: int, written: int) -> float:
        """How long the disk alone takes to read ``read`` bytes and write ``written`` ones, at ``dd``'s pace."""
        return read / self.read_rate + written / self.write_rate

    def share(self, read: int, written: int, wall: float) -> float:
        return self.seconds_for(read, written) / wall

    def line(self) -> str:
        return (f"dd: read {self.read_bytes / 1e9:.2f} GB in {self.read_seconds:.1f} s ({self.read_rate / 1e6:.0f} MB/s), "
                f"wrote {self.write_bytes / 1e9:.2f} GB with fdatasync in {self.write_seconds:.1f} s "
                f"({self.write_rate / 1e6:.0f} MB/s)")


def measure(read: list[Path], write_bytes: int, scratch: Path) -> Disk:
    """``dd`` reading ``read`` (evicted first, one process per file, timed together) and writing ``write_bytes`` of
    zeros to a file in ``scratch`` (removed after)."""
    evict(read)
    start = time.perf_counter()
    for path in read:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}"], check=True, capture_output=True)
    read_seconds = time.perf_counter() - start
    target = scratch / "dd-write"
    count = -(-write_bytes // (16 << 20))
    os.sync()
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", f"bs={DD_BLOCK}", f"count={count}", "conv=fdatasync"],
                   check=True, capture_output=True)
    write_seconds = time.perf_counter() - start
    written = target.stat().st_size
    target.unlink()
    return Disk(size_of(read), read_seconds, written, write_seconds)
