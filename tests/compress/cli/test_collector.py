"""The garbage collector's pause during a command's start-up (`compress.cli.collector`)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from compress.cli.collector import pause_collector, resuming_collector
from conftest import REFERENCE_MODEL

# The `compress` command in a fresh interpreter, with the collector's state recorded where the run starts and where
# the process ends (the run itself is the command's own).
DRIVER = """
import gc, json, os, sys
import compress.cli.console as console
import compress.run.runner as runner
seen = {}
real_run = runner.run_recipe
def run_recipe(recipe, progress=None, *args, **kwargs):
    seen["enabled when the run starts"] = gc.isenabled()
    result = real_run(recipe, progress, *args, **kwargs)
    seen["enabled when the run ends"] = gc.isenabled()
    return result
runner.run_recipe = run_recipe
def finish_process(code):
    seen.update({"enabled at the end": gc.isenabled(), "frozen": gc.get_freeze_count(), "code": code})
    print("SEEN" + json.dumps(seen), flush=True)
    os._exit(0)
console.finish_process = finish_process
import compress.cli.app
app = sys.modules["compress.cli.app"]  # the package's `app` is the Typer application
app.finish_process = finish_process
sys.argv = ["compress", *sys.argv[1:]]
app.main()
"""


def _command(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=300)
    line = next((line for line in out.stdout.splitlines() if line.startswith("SEEN")), None)
    assert line is not None, out.stdout + out.stderr
    return json.loads(line[4:])


def test_the_first_report_turns_the_collector_back_on_with_the_start_up_frozen():
    reports = []
    pause_collector()
    try:
        assert not gc.isenabled()
        progress = resuming_collector(lambda *report: reports.append(report))
        progress("blocks", 1, 3)
        assert gc.isenabled() and gc.get_freeze_count() > 0
        progress("blocks", 2, 3)
        assert reports == [("blocks", 1, 3), ("blocks", 2, 3)]
    finally:
        gc.unfreeze()  # this test process's objects back within the collector's reach
        gc.enable()


def test_a_run_starts_with_the_collector_paused_and_ends_with_it_on(tmp_path):
    seen = _command("quantize", str(REFERENCE_MODEL.resolve()), "-o", str(tmp_path / "out"), "--method", "rtn", "--json")
    assert seen["code"] in (0, None)
    assert seen["enabled when the run starts"] is False  # the imports and the model's loading ran without it
    assert seen["enabled when the run ends"] is True and seen["frozen"] > 0  # its first progress report resumed it


def test_a_command_that_fails_before_any_progress_still_ends_with_the_collector_on(tmp_path):
    seen = _command("quantize", str(tmp_path / "missing"), "-o", str(tmp_path / "out"), "--method", "rtn")
    assert seen["code"] == 2
    assert seen["enabled at the end"] is True
