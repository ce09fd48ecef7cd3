"""Tests for compress.cli.console: the command recorded for a run."""

from __future__ import annotations

import sys

from compress.cli.console import command_line


def test_the_recorded_command_leaves_out_resume(monkeypatch):
    """A resumed run records the command of the run it continued: its output's bytes are the same."""
    monkeypatch.setattr(sys, "argv", ["/usr/bin/compress", "quantize", "m", "-o", "out dir", "--resume", "--json"])
    assert command_line() == "compress quantize m -o 'out dir' --json"
