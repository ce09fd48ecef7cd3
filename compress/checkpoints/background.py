"""Work run beside the main thread, its result taken when needed."""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """``fn()`` on a daemon thread; `result` waits for it and returns its value or raises its exception.

    For input digests (`compress.checkpoints.output.run_inputs`): SHA-256 releases the GIL on large chunks,
    so a model's files are hashed on a core the main thread leaves idle while it imports the model's code and
    reads the calibration text (0.3 s of a 15 s run on SmolLM2's first 8 blocks; ~30 s for a 7B checkpoint).
    Also for the GGUF export's check of config.json against the weights (`compress.checkpoints.model_io.open_model`:
    ~2.7 s of transformers' imports on a fresh process), made while the first tensors are encoded.
    A daemon thread, so that a run failing before the result is taken exits at once instead of waiting for it.
    What ``fn`` changes process-wide is seen by the main thread meanwhile: transformers sets torch's default dtype
    while it builds a model (float16 for a float16 config), so code that runs beside the config check names its
    dtypes (the encoders' bytes are tested under another default, tests/formats/gguf/test_codecs.py)."""

    def __init__(self, fn: Callable[[], T], name: str = "background"):
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of `result`
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def done(self) -> bool:
        """``fn`` has returned or raised: `result` will not wait."""
        return not self._thread.is_alive()

    def raise_if_failed(self) -> None:
        """Raise ``fn``'s exception if it has already failed; return at once otherwise (finished or not)."""
        if self.done() and self._error is not None:
            raise self._error


class InOrder:
    """Calls run one after another on a daemon thread of their own, in the order they were given, while the caller
    goes on: a writer's file writes beside the work that produces the next tensors (the disk's write-back and the
    kernel's throttling of dirty pages then wait on this thread, not on the main one).

    ``limit``: the bytes the calls given but not yet run may hold (each call says how many it holds); `submit` waits
    while more are held, so memory stays bounded (one call larger than the limit still runs, alone). After a call
    raises, later calls are skipped, and `submit`, `check` and `drain` raise that exception in the caller's thread."""

    def __init__(self, limit: int, name: str = "in-order"):
        self.limit = limit
        self._name = name
        self._calls: list[tuple[Callable[[], object], int]] = []
        self._held = 0  # bytes of the calls given and not yet finished
        self._condition = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, call: Callable[[], object], held: int = 0) -> None:
        with self._condition:
            while self._held and self._held + held > self.limit and self._error is None:
                self._condition.wait()
            self.check()
            self._calls.append((call, held))
            self._held += held
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def _run(self) -> None:
        while True:
            with self._condition:
                if not self._calls:
                    self._thread = None  # the next submit starts another: no idle thread outlives the work
                    self._condition.notify_all()
                    return
                call, held = self._calls[0]
            try:
                if self._error is None:
                    call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self._error = exc
            with self._condition:
                self._calls.pop(0)
                self._held -= held
                self._condition.notify_all()

    def check(self) -> None:
        """Raise the exception of a call that failed, if one has."""
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Wait until every call given has run, then raise the exception of one that failed, if one has."""
        with self._condition:
            while self._calls:
                self._condition.wait()
        self.check()
