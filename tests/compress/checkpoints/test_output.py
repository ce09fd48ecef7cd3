"""Tests for compress.checkpoints.output: continuing a killed run's temporary directory (``resume``), and how
stale temporary directories are reported without it, and removed once a run completes the output. (Locks, signals and full disks: tests/compress/cli/test_faults.py.)"""

from __future__ import annotations

import logging
import os
import time

import pytest

from compress.checkpoints.output import PROGRESS, PROGRESS_RECORD, OutputDir, resumable
from compress.errors import CompressError


def _killed_run(folder, name: str, pid: int, block: int | None) -> os.PathLike:
    """A temporary directory as a killed run of ``folder/name`` leaves it (with a progress record if ``block``)."""
    tmp = folder / f".{name}.partial-{pid}"
    tmp.mkdir()
    (tmp / "shard-00000.data").write_bytes(b"x" * 8)
    if block is not None:
        (tmp / PROGRESS).mkdir()
        (tmp / PROGRESS / PROGRESS_RECORD).write_text(f'{{"block": {block}}}\n')
    return tmp


def test_resume_takes_the_latest_recorded_run_and_removes_the_others_once_complete(tmp_path, caplog):
    older = _killed_run(tmp_path, "out", 999_991, 0)
    past = time.time() - 60
    os.utime(older / PROGRESS / PROGRESS_RECORD, (past, past))
    newer = _killed_run(tmp_path, "out", 999_992, 2)
    unrecorded = _killed_run(tmp_path, "out", 999_993, None)
    checked = []
    output = OutputDir(tmp_path / "out", resume=checked.append)
    with caplog.at_level(logging.WARNING), output as tmp:
        assert output.resumed and checked == [newer]
        assert (tmp / "shard-00000.data").read_bytes() == b"x" * 8 and resumable(tmp)  # the killed run's files, kept
        assert not newer.exists()
        (tmp / PROGRESS / PROGRESS_RECORD).unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # superseded by the complete output
    assert f"removed 2 left by interrupted runs of {tmp_path / 'out'}, superseded by this one: {older.name}, {unrecorded.name}" in caplog.text
    assert f"{older} was left by an interrupted run and is not used; continue it with the same command and --resume" in caplog.text
    assert f"{unrecorded} was left by an interrupted run and is not used; remove it with: rm -rf {unrecorded}" in caplog.text


def test_a_refused_resume_leaves_the_killed_run_as_it_was(tmp_path):
    killed = _killed_run(tmp_path, "out", 999_991, 1)
    before = sorted(str(p.relative_to(killed)) for p in killed.rglob("*"))

    def refuse(directory):
        raise CompressError(f"--resume: the interrupted run in {directory} differs: setting bits was 4, now 3")

    with pytest.raises(CompressError, match="setting bits was 4, now 3"):
        with OutputDir(tmp_path / "out", resume=refuse):
            pass
    assert sorted(str(p.relative_to(killed)) for p in killed.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [killed.name]  # no output, no lock


def test_resume_without_a_recorded_run_is_one_line(tmp_path):
    _killed_run(tmp_path, "out", 999_991, None)
    _killed_run(tmp_path, "other", 999_992, 3)  # another output's run is not this one's
    with pytest.raises(CompressError) as caught:
        with OutputDir(tmp_path / "out", resume=lambda directory: None):
            pass
    message = str(caught.value)
    assert "\n" not in message and "no interrupted run of" in message and "run without --resume" in message
    assert not (tmp_path / "out").exists()


def test_without_resume_a_recorded_run_is_reported_with_both_commands(tmp_path, caplog):
    killed = _killed_run(tmp_path, "out", 999_991, 1)
    with caplog.at_level(logging.WARNING), OutputDir(tmp_path / "out") as tmp:
        assert not resumable(tmp)  # a fresh directory: the killed run's progress is never silently reused
        assert killed.is_dir()  # kept while this run may still fail
    assert not killed.exists() and "removed 1 left by interrupted runs" in caplog.text
    assert (f"{killed} was left by an interrupted run and is not used; continue it with the same command and --resume, "
            f"or remove it with: rm -rf {killed}") in caplog.text


def test_a_failed_run_removes_nothing_and_a_live_pid_is_kept(tmp_path, caplog):
    dead = _killed_run(tmp_path, "out", 999_991, None)
    live = _killed_run(tmp_path, "out", os.getppid(), None)  # a process that exists: never removed
    with pytest.raises(RuntimeError), OutputDir(tmp_path / "out"):
        raise RuntimeError("the run fails")
    assert dead.is_dir() and live.is_dir()
    with caplog.at_level(logging.WARNING), OutputDir(tmp_path / "out"):
        pass
    assert not dead.exists() and live.is_dir()
    assert f"removed 1 left by interrupted runs of {tmp_path / 'out'}, superseded by this one: {dead.name}" in caplog.text
