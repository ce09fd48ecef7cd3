"""The `compress` Typer application: the root options and every command group's registration."""

from __future__ import annotations

import logging

import typer

from compress import __version__
from compress.cli import allocator
from compress.cli.collector import pause_collector, resume_collector
from compress.cli.console import finish_process, install_signal_handlers, quiet_other_ranks, stdout

app = typer.Typer(
    name="compress",
    help="Offline compression toolkit for large language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
eval_app = typer.Typer(help="Evaluate models.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")
@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context, version: bool = typer.Option(False, "--version", help="Show the version and exit.")) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    allocator.set_allocator(allocator.allocator_policy(ctx.invoked_subcommand))
    if version:
        stdout.print(f"llm-compress {__version__}")
        raise typer.Exit()


def _register_commands() -> None:
    from compress.cli import compressing, convert, distill, evaluate, export, inspect, measure, report, speculative, verify

    compressing.register(app)  # quantize, prune, run
    evaluate.register(app, eval_app)  # eval ppl, reference-model
    inspect.register(app)  # inspect, methods
    distill.register(app)
    export.register(app)  # export, imatrix
    convert.register(app)  # convert (GGUF in)
    report.register(app, eval_app)  # report, sweep, eval lm-eval
    measure.register(app)  # measure, allocate (per-layer sensitivity, plans)
    speculative.register(eval_app)  # eval speculative
    verify.register(app)  # verify (an output against its manifest)


_register_commands()


def main() -> None:
    install_signal_handlers()  # the process is ours: SIGTERM stops a run as Ctrl-C does, cleaning up
    quiet_other_ranks()
    pause_collector()  # until the run's first progress report: the start-up's imports (`compress.cli.collector`)
    code: int | str | None = 0
    try:
        app()
    except SystemExit as done:  # Typer ends every command, successful or not, with sys.exit
        code = done.code
    finally:
        resume_collector()  # a command that reported no progress (or main called in-process, as tests do)
    finish_process(code)  # a traceback (a bug) is not caught: it exits the usual way

