"""Terminal output for the CLI (Rich): progress bars, tables, errors. The library never prints."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shlex
import signal
import sys
import threading
from typing import Any, Callable, Iterator

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from compress.cli.collector import resuming_collector
from compress.errors import CompressError

console = Console(stderr=True)  # progress and tables; stdout stays clean for --json
stdout = Console()
errors = Console(stderr=True)  # never quiet: an error may be one rank's alone


def launched_rank() -> int:
    """This process's rank under a launcher (torchrun and accelerate set RANK); 0 without one."""
    return int(os.environ.get("RANK", "0"))


def quiet_other_ranks() -> None:
    """Under a launcher every rank runs the same command: only rank 0 shows progress, layers and summaries."""
    if launched_rank() != 0:
        console.quiet = stdout.quiet = True


def command_line() -> str:
    """The command as the user typed it, for run records and model cards; without ``--resume``, so that a
    resumed run records the command of the run it continued (and writes the same bytes)."""
    return shlex.join(["compress", *(arg for arg in sys.argv[1:] if arg != "--resume")])

PHASE_LABELS = {"calibration": "capturing calibration inputs", "blocks": "compressing blocks", "evaluation": "evaluating"}


class Terminated(BaseException):
    """SIGTERM (or SIGHUP) arrived: unwinds like KeyboardInterrupt, so every ``with`` removes its temporary
    files, and no ``except Exception`` in a library stops it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, _frame) -> None:
    raise Terminated(signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP stop the run as Ctrl-C does (by default they kill the process where it stands,
    leaving its temporary output behind). Only the process owner (`compress.cli.app.main`) calls this."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)


def finish_process(code: int | str | None) -> None:
    """End the process as the interpreter's own exit does, less its last step: the module teardown.

    Python's exit stops the threads (the thread pools' exit hooks, then a join of every non-daemon thread), runs the
    ``atexit`` handlers (logging's flush, temporary directories' cleanup ...), flushes stdout and stderr, and then
    frees the objects of every loaded module one by one. With torch and transformers loaded that last step took
    0.7-1.0 s on a 2-core machine (``import torch._dynamo``, then exit: 2.88 s against 2.23 s), a wait after the
    work is done and every file is closed. Only the process owner (`compress.cli.app.main`) calls this; the exit
    status is ``code``'s as `sys.exit` reads it (None 0, a message printed to stderr and 1)."""
    shutdown = getattr(threading, "_shutdown", None)  # private, but what the interpreter itself calls on exit
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing more can reach it anyway
            stream.flush()
    os._exit(0 if code is None else int(code))


def user_errors(fn: Callable) -> Callable:
    """Turn a `CompressError` into a one-line message and exit status 2 (no traceback); Ctrl-C and SIGTERM
    into one line and 128 + the signal's number, after the temporary output was removed."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CompressError as exc:
            rank = f"rank {launched_rank()}: " if launched_rank() else ""
            errors.print(f"[bold red]error:[/] {rank}{exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except (KeyboardInterrupt, Terminated) as exc:
            signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
            name = signal.Signals(signum).name
            console.print(f"[bold red]interrupted[/] by {name}: stopped; the partial output was removed, nothing was written",
                          highlight=False, soft_wrap=True)
            raise typer.Exit(128 + signum) from None

    return wrapper


@contextlib.contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Callable[[str, int, int], None]]:
    """A ``(phase, done, total)`` callback that drives one Rich progress bar per phase; its first report ends the
    start-up's pause of the garbage collector (`compress.cli.collector`)."""
    if not enabled:
        yield resuming_collector(lambda phase, done, total: None)
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    tasks: dict[str, int] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(PHASE_LABELS.get(phase, phase), total=total)
        progress.update(tasks[phase], completed=done, total=total)

    with progress:
        yield resuming_collector(update)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def layer_line(report) -> str:
    """One finished layer, printed live above the progress bars."""
    out_features, in_features = report.shape
    figures = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in report.info.items())
    return f"  {report.name}  [{out_features}×{in_features}]  {report.seconds:.2f}s  {figures}"


def key_value_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows.items():
        table.add_row(k, str(v))
    return table


def print_json(data: Any) -> None:
    if not stdout.quiet:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
