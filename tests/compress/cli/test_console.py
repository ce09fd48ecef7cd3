"""Tests for compress.cli.console: the command recorded for a run, the process's exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from compress.cli.console import command_line


def test_the_recorded_command_leaves_out_resume(monkeypatch):
    """A resumed run records the command of the run it continued: its output's bytes are the same."""
    monkeypatch.setattr(sys, "argv", ["/usr/bin/compress", "quantize", "m", "-o", "out dir", "--resume", "--json"])
    assert command_line() == "compress quantize m -o 'out dir' --json"


FINISH = """
import atexit, sys, threading, time
from pathlib import Path
from compress.cli.console import finish_process

out = Path(sys.argv[1])

def late_writer():
    time.sleep(0.3)
    (out / "thread.txt").write_text("written by a non-daemon thread")

threading.Thread(target=late_writer).start()
atexit.register(lambda: (out / "atexit.txt").write_text("atexit ran"))
sys.stdout.write("unflushed stdout")  # no newline: still in the buffer
finish_process(eval(sys.argv[2]))
raise AssertionError("finish_process returned")
"""


@pytest.mark.parametrize("code, status", [("0", 0), ("None", 0), ("2", 2), ("'bad input: fix it'", 1)])
def test_finish_process_exits_as_the_interpreter_would(tmp_path, code, status):
    """What a normal exit guarantees still happens: non-daemon threads finish, atexit handlers run, buffered
    output is written; the exit status is sys.exit's reading of the code."""
    done = subprocess.run([sys.executable, "-c", FINISH, str(tmp_path), code], capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed stdout"
    assert (tmp_path / "thread.txt").read_text() == "written by a non-daemon thread"
    assert (tmp_path / "atexit.txt").read_text() == "atexit ran"
    assert ("bad input: fix it" in done.stderr) == (status == 1)
