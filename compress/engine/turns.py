"""Tasks that take turns: each runs on a thread of its own, one at a time, handing over at points it chooses.

The one-pass engine (`compress.engine.one_pass`) transforms a group of layers once every calibration window has
reached it, then runs every window on through it. One forward pass over all windows in one batch does that, but
then each of its temporaries is as large as the whole batch (an MLP's gate, up and product: 100 MB each for
SmolLM2's 32 × 512 tokens), and glibc maps and zero-fills fresh pages for every one of them. Cut into chunks of
windows whose forward passes take turns (`passes.run_solving`: a chunk runs until it reaches a group, hands over to
the next one, and the last to arrive transforms the group), each temporary is a chunk's: small enough for the heap,
where the next chunk reuses its pages. A forward pass cannot be paused and resumed in one thread, so each chunk's
runs in its own; only one runs at a time, so their operations keep every intra-op thread and nothing is shared
concurrently (the solvers, `torch.set_num_threads`).
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class Abandoned(Exception):
    """Raised in a task waiting for its turn when another task failed: it ends without running further."""


class Turns:
    """The turn of ``count`` tasks, numbered in turn order; task 0 starts. A task runs until it calls `hand_over`,
    which wakes the next unfinished task (cyclically) and waits for its own turn to come round again."""

    def __init__(self, count: int):
        self.count = count
        self._turn = 0
        self._finished = [False] * count
        self._failure: BaseException | None = None
        self._changed = threading.Condition()

    def wait(self, task: int) -> None:
        """Block until it is ``task``'s turn (`Abandoned` if another task failed meanwhile)."""
        with self._changed:
            self._changed.wait_for(lambda: self._turn == task or self._failure is not None)
            if self._failure is not None:
                raise Abandoned from None

    def hand_over(self, task: int) -> None:
        """``task`` (whose turn it is) lets the next unfinished task run, and waits for its turn to come round."""
        with self._changed:
            self._turn = self._next(task)
            self._changed.notify_all()
        self.wait(task)

    def finish(self, task: int) -> None:
        with self._changed:
            self._finished[task] = True
            if not all(self._finished):
                self._turn = self._next(task)
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._changed:
            if self._failure is None:
                self._failure = error
            self._changed.notify_all()

    def _next(self, task: int) -> int:
        for step in range(1, self.count + 1):
            other = (task + step) % self.count
            if not self._finished[other]:
                return other
        return task


def take_turns(tasks: list[Callable[[Turns, int], T]]) -> list[T]:
    """``tasks[i](turns, i)`` for every task, one at a time in turn order (each hands over with
    ``turns.hand_over(i)``): task 0 on this thread, the others on threads of their own, started with this thread's
    intra-op thread count (a new thread would start with OpenMP's default team). Returns their results in order;
    the first task to raise stops the others at their next turn and its exception is raised here."""
    turns = Turns(len(tasks))
    results: list = [None] * len(tasks)
    errors: list[BaseException] = []
    threads = torch.get_num_threads()

    def run(i: int) -> None:
        try:
            if i:
                torch.set_num_threads(threads)
                turns.wait(i)
            results[i] = tasks[i](turns, i)
            turns.finish(i)
        except Abandoned:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, KeyboardInterrupt included
            errors.append(exc)
            turns.fail(exc)

    helpers = [threading.Thread(target=run, args=(i,), name=f"turn-{i}", daemon=True) for i in range(1, len(tasks))]
    for helper in helpers:
        helper.start()
    run(0)
    try:
        for helper in helpers:
            helper.join()
    except BaseException as exc:  # interrupted while waiting: the others stop at their next turn
        turns.fail(exc)
        raise
    if errors:
        raise errors[0]
    return results
