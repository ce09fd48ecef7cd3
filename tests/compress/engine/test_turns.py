"""`compress.engine.turns`: tasks on threads that run one at a time, handing over in turn order."""

from __future__ import annotations

import threading

import pytest

from compress.engine.turns import take_turns


def test_tasks_run_one_at_a_time_in_turn_order():
    log, running = [], []

    def task(steps):
        def run(turns, i):
            for step in range(steps):
                running.append(i)
                assert running == [i]  # nobody else runs meanwhile
                log.append((i, step))
                running.pop()
                turns.hand_over(i)
            return i * 10

        return run

    assert take_turns([task(3), task(1), task(2)]) == [0, 10, 20]
    # round robin over the tasks not yet finished
    assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]


def test_the_first_failure_is_raised_and_every_thread_ends():
    threads = threading.active_count()

    def waits_forever(turns, i):
        while True:
            turns.hand_over(i)

    def fails(turns, i):
        turns.hand_over(i)
        raise LookupError(i)

    with pytest.raises(LookupError, match="2"):
        take_turns([waits_forever, waits_forever, fails, waits_forever])
    assert threading.active_count() == threads


def test_one_task_runs_on_the_calling_thread():
    assert take_turns([lambda turns, i: threading.current_thread() is threading.main_thread()]) == [True]
