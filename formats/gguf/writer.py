"""A GGUF file written under a temporary name next to its path and renamed only when complete."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


@contextmanager
def atomic_gguf_writer(path: Path, arch: str, finish: Callable[[Path], None] | None = None) -> Iterator["gguf.GGUFWriter"]:  # noqa: F821
    """A ``gguf.GGUFWriter`` on ``.<name>.tmp-<pid>`` beside ``path``: on leaving the block it is closed,
    given to ``finish`` (e.g. to record its digest) and renamed to ``path``; on any error it is closed and
    removed, so no half-written file is left."""
    import gguf

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        yield writer
        writer.close()
        if finish is not None:
            finish(tmp)
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
