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


def test_in_order_runs_calls_in_their_order_on_one_other_thread():
    from compress.checkpoints.background import InOrder

    seen, threads = [], set()
    work = InOrder(limit=100)
    for i in range(50):
        work.submit(lambda i=i: (seen.append(i), threads.add(threading.current_thread())), held=10)
    work.drain()
    assert seen == list(range(50))
    assert threading.main_thread() not in threads and all(t.daemon for t in threads)


def test_in_order_holds_no_more_than_its_limit_but_runs_a_larger_call_alone():
    from compress.checkpoints.background import InOrder

    release, running = threading.Event(), threading.Event()
    work = InOrder(limit=10)
    work.submit(lambda: running.set() or release.wait(), held=8)
    running.wait()
    waited = threading.Event()

    def second():
        work.submit(lambda: None, held=5)  # 8 + 5 > 10: waits for the first call
        waited.set()

    helper = threading.Thread(target=second)
    helper.start()
    assert not waited.wait(0.2)
    release.set()
    helper.join(5)
    assert waited.is_set()
    work.submit(lambda: None, held=1000)  # nothing held: runs, larger than the limit
    work.drain()


def test_in_order_skips_later_calls_after_a_failure_and_raises_in_the_callers_thread():
    from compress.checkpoints.background import InOrder

    seen = []
    work = InOrder(limit=100)
    work.submit(lambda: seen.append(1))
    work.submit(lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    work.submit(lambda: seen.append(3))
    with pytest.raises(OSError, match="No space left"):
        work.drain()
    with pytest.raises(OSError, match="No space left"):
        work.submit(lambda: seen.append(4))
    assert seen == [1]
