"""The process's garbage collector while a command starts: set by the CLI (the process owner), not the library.

Importing torch, transformers and a model's code builds a heap of objects that live as long as the process
(modules, functions, classes), and the collector walks all of them again at every full collection: it made 7 of
them in the first 4 s of `compress quantize` on SmolLM2's first 8 blocks, the last ones 120-190 ms each, 0.52-0.55 s
in all (`gc.callbacks`). Start-up makes no garbage cycles worth that, so the collector is off until the run's first
progress report (the model is open and the calibration set read by then) and then back on with every object alive
at that point frozen (`gc.freeze`: never collected, never walked again). The run itself collects as before."""

from __future__ import annotations

import gc
from typing import Callable

ProgressFn = Callable[[str, int, int], None]


def pause_collector() -> None:
    """The collector off for the start-up (`resume_collector` turns it back on)."""
    gc.disable()


def resume_collector() -> None:
    """The collector on again, every object alive now out of its reach; nothing if it is already on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def resuming_collector(progress: ProgressFn) -> ProgressFn:
    """``progress``, turning the collector back on at its first report."""

    def report(phase: str, done: int, total: int) -> None:
        resume_collector()
        progress(phase, done, total)

    return report
