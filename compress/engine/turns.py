"""Tasks that take turns: each a greenlet on the calling thread, one at a time, handing over at points it chooses.

The one-pass engine (`compress.engine.one_pass`) transforms a group of layers once every calibration window has
reached it, then runs every window on through it. One forward pass over all windows in one batch does that, but
then each of its temporaries is as large as the whole batch (an MLP's gate, up and product: 100 MB each for
SmolLM2's 32 × 512 tokens), and glibc maps and zero-fills fresh pages for every one of them. Cut into chunks of
windows whose forward passes take turns (`passes.run_solving`: a chunk runs until it reaches a group, hands over to
the next one, and the last to arrive transforms the group), each temporary is a chunk's: small enough for the heap,
where the next chunk reuses its pages.

A forward pass cannot be paused and resumed by plain Python code, so each chunk's runs in a greenlet of its own (a
stack of its own, switched on one thread). Not threads taking turns: each thread would drive an OpenMP team of its
own, and handing the cores from one team to the next costs (a Gram sum of 5 windows of 512, 576 wide: 8.4 ms on one
thread, 12.4 ms on two threads taking turns). On one thread every chunk's operations run on the same team, and
Ctrl-C reaches whichever chunk runs.

The tasks share the thread's state: torch's thread-local modes (inference mode, grad mode) are the caller's, so
a task must not change them across a hand-over (enter them around `take_turns`, not inside a task).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from greenlet import GreenletExit, getcurrent, greenlet

T = TypeVar("T")


class Turns:
    """The turn of ``count`` tasks, numbered in turn order; task 0 starts. A task runs until it calls `hand_over`,
    which runs the next unfinished task (cyclically) and returns when the task's turn comes round again.
    ``current``: the task running now."""

    def __init__(self, count: int):
        self.count = count
        self.current = 0
        self._finished = [False] * count
        self._scheduler = getcurrent()  # `take_turns`'s greenlet, which switches into each task in turn

    def hand_over(self, task: int) -> None:
        """``task`` (whose turn it is) lets the next unfinished task run, and waits for its turn to come round."""
        following = self._next(task)
        if following != task:
            self._scheduler.switch(following)

    def _finish(self, task: int) -> int:
        self._finished[task] = True
        return self._next(task)

    def _next(self, task: int) -> int:
        """The next unfinished task after ``task`` in turn order (``task`` itself when every other has finished)."""
        for step in range(1, self.count + 1):
            other = (task + step) % self.count
            if not self._finished[other]:
                return other
        return task

    def _all_finished(self) -> bool:
        return all(self._finished)


def take_turns(tasks: list[Callable[[Turns, int], T]]) -> list[T]:
    """``tasks[i](turns, i)`` for every task, one at a time in turn order (each hands over with
    ``turns.hand_over(i)``), each in a greenlet of its own on this thread. Returns their results in order; the first
    task to raise ends the others (`GreenletExit` at their hand-over, so their ``finally`` blocks run) and its
    exception is raised here."""
    turns = Turns(len(tasks))
    results: list = [None] * len(tasks)

    def run(i: int) -> int:
        results[i] = tasks[i](turns, i)
        return turns._finish(i)

    runs = [greenlet(lambda i=i: run(i)) for i in range(len(tasks))]
    task = 0
    try:
        while not turns._all_finished():
            turns.current = task
            task = runs[task].switch()  # the next task: handed over to, or after this one finished
    except BaseException:
        for suspended in runs:  # started and not finished: unwind them here, not whenever they are collected
            if suspended:
                suspended.throw(GreenletExit)
        raise
    return results
