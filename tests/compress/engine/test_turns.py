"""`compress.engine.turns`: tasks in greenlets that run one at a time on the calling thread, handing over in turn order."""

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


def test_the_first_failure_is_raised_and_every_task_ends():
    threads, unwound = threading.active_count(), []

    def waits_forever(turns, i):
        try:
            while True:
                turns.hand_over(i)
        finally:
            unwound.append(i)

    def fails(turns, i):
        turns.hand_over(i)
        raise LookupError(i)

    with pytest.raises(LookupError, match="2"):
        take_turns([waits_forever, waits_forever, fails, waits_forever])
    assert sorted(unwound) == [0, 1, 3]  # each suspended task was unwound (its finally ran) before the error came out
    assert threading.active_count() == threads


def test_every_task_runs_on_the_calling_thread_and_knows_its_turn():
    def task(turns, i):
        seen = [(turns.current, threading.current_thread() is threading.main_thread())]
        turns.hand_over(i)
        return seen + [(turns.current, threading.current_thread() is threading.main_thread())]

    assert take_turns([task, task, task]) == [[(i, True), (i, True)] for i in range(3)]


def test_a_task_that_hands_over_last_runs_on():
    def first(turns, i):
        return "first"

    def second(turns, i):
        turns.hand_over(i)  # the first has finished: nobody to hand over to
        turns.hand_over(i)
        return "second"

    assert take_turns([first, second]) == ["first", "second"]
