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


# -- `compress` commands in forked children (tests/compress/cli/test_faults.py) --------------------------
def run_cli(argv: list[str], log_path: str, slow_writes: float = 0.0) -> None:
    """Run ``compress ARGV`` as the console script does (signal handlers included), its stdout and stderr to
    ``log_path`` (what a killed child wrote stays there). ``slow_writes``: seconds to sleep before each
    tensor is written, so a test can signal the run while its temporary output exists."""
    import sys

    import torch

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    # Ctrl-C as in a foreground terminal: a test run started in the background (`nohup ... &`, a CI runner's
    # shell) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if slow_writes:
        from compress.checkpoints.shards import ShardedWriter

        add = ShardedWriter.add

        def slow_add(self, name, tensor):
            time.sleep(slow_writes)
            add(self, name, tensor)

        ShardedWriter.add = slow_add
        import gguf

        write = gguf.GGUFWriter.write_tensor_data

        def slow_write(self, *args, **kwargs):
            time.sleep(slow_writes)
            return write(self, *args, **kwargs)

        gguf.GGUFWriter.write_tensor_data = slow_write
    sys.argv = ["compress", *argv]
    from compress.cli.app import main

    main()

