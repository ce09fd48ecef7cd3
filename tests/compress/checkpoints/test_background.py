"""`Background`: a value or an exception from another thread, and a run's input digests taken that way."""

from __future__ import annotations

import threading

import pytest

from compress.checkpoints.output import run_inputs
from compress.checkpoints.background import Background


def test_the_result_is_the_functions_value_computed_on_another_thread():
    seen = []
    job = Background(lambda: seen.append(threading.current_thread()) or 42)
    assert job.result() == 42 and job.result() == 42
    assert seen[0] is not threading.main_thread() and seen[0].daemon


def test_an_exception_reaches_the_caller_of_result():
    def fail():
        raise ValueError("no such file")

    job = Background(fail)
    with pytest.raises(ValueError, match="no such file"):
        job.result()
    with pytest.raises(ValueError, match="no such file"):
        job.raise_if_failed()


def test_raise_if_failed_does_not_wait():
    release = threading.Event()
    job = Background(lambda: release.wait() and 1 / 0)
    job.raise_if_failed()  # still running: returns at once
    release.set()
    with pytest.raises(ZeroDivisionError):
        job.result()
    Background(lambda: 7).raise_if_failed()


def test_digests_in_the_background_are_the_digests(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    assert Background(lambda: run_inputs(tmp_path)).result() == run_inputs(tmp_path)
