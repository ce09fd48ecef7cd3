"""The calibration inputs of the block being compressed, in memory up to a budget and on disk beyond it.

The engine keeps one ``(hidden, args, kwargs)`` entry per calibration batch: the block's input hidden states
``[batch, seq_len, hidden]`` and the other arguments the architecture passes (masks, positions). With many
long windows the hidden states outgrow memory (512 windows x 2048 tokens x 8192 wide in float32 are 34 GB), so
`Activations` holds them in memory while they fit ``budget`` bytes (``--activation-memory``) and writes the rest
to an unnamed temporary file, reading each back when a pass needs it and letting it go after. Explicit reads,
not a memory map: mapped pages count in the process's resident memory until the kernel reclaims them, so the
peak would follow the calibration size instead of the budget. The file is unlinked when created, so nothing is
left behind, whatever ends the process. The other arguments are small and stay in memory.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch


def scratch_beside(output: Path) -> Path | None:
    """Where a run writing ``output`` keeps block inputs beyond its budget: the output's folder, or its nearest
    existing ancestor while the run has not made it yet (the disk the output goes to, not a possibly memory-backed
    system temporary folder), else the system's temporary folder."""
    return next((folder for folder in output.absolute().parents if folder.is_dir()), None)


@dataclass(frozen=True)
class _OnDisk:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class Activations:
    """A sequence of ``(hidden, args, kwargs)`` batches; hidden states beyond ``budget`` bytes live on disk
    (in ``directory``, default the system's temporary directory). ``budget`` None: all in memory."""

    def __init__(self, budget: int | None = None, directory: Path | None = None):
        self.budget = budget
        self.directory = directory
        self._entries: list[tuple[torch.Tensor | _OnDisk, tuple, dict]] = []
        self._in_memory = 0  # bytes of hidden states held
        self._file = None

    def append(self, hidden: torch.Tensor, args: tuple, kwargs: dict) -> None:
        size = hidden.numel() * hidden.element_size()
        if self.budget is not None and self._in_memory + size > self.budget:
            self._entries.append((self._write(hidden), args, kwargs))
        else:
            self._in_memory += size
            self._entries.append((hidden, args, kwargs))

    def _write(self, hidden: torch.Tensor) -> _OnDisk:
        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.directory, prefix=".activations-")
        offset = self._file.seek(0, 2)
        data = hidden.detach().contiguous().cpu()
        self._file.write(data.reshape(-1).view(torch.uint8).numpy().data)
        return _OnDisk(offset, tuple(hidden.shape), hidden.dtype, hidden.device)

    def _read(self, where: _OnDisk) -> torch.Tensor:
        buffer = bytearray(where.nbytes)
        self._file.seek(where.offset)
        self._file.readinto(buffer)
        return torch.frombuffer(buffer, dtype=torch.uint8).view(where.dtype).reshape(where.shape).to(where.device)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, tuple, dict]:
        hidden, args, kwargs = self._entries[index]
        return (self._read(hidden) if isinstance(hidden, _OnDisk) else hidden), args, kwargs

    def __iter__(self) -> Iterator[tuple[torch.Tensor, tuple, dict]]:
        for index in range(len(self._entries)):
            yield self[index]

    def copy(self, into: "Activations") -> "Activations":
        """``into`` with every batch of this store appended (hidden states in memory are shared, not copied)."""
        for entry in self:
            into.append(*entry)
        return into

    @property
    def spilled_bytes(self) -> int:
        return sum(h.nbytes for h, _, _ in self._entries if isinstance(h, _OnDisk))

    def close(self) -> None:
        """Drop the disk copy (the entries in memory stay readable)."""
        if self._file is not None:
            self._file.close()
            self._file = None
