"""Functions the tests run inside a `LlamaCppWorker` child (importable there by name: tests/ is on the path)."""

from __future__ import annotations

import os
import signal
import time


def die(state: dict, signum: int) -> None:
    """Kill the child with ``signum``, as a crash inside llama.cpp would (SIGILL: an illegal instruction)."""
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, so need no reset
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    time.sleep(10)  # not reached for a fatal signal


def hang(state: dict) -> None:
    time.sleep(3600)


def remember(state: dict, key: str, value):
    state[key] = value
    return sorted(state)
