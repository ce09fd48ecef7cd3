"""Faults during a run, each provoked on a real `compress` process: a full disk, SIGINT and SIGTERM, SIGKILL
at random points, two runs writing the same output. Never a traceback, never a partial or mixed output,
the input untouched, and what a killed run leaves behind reported by the next one.

The commands run in children forked from a forkserver that has imported torch, transformers and the CLI
once (`tests/child_helpers.run_cli`), so a child starts in milliseconds, not the seconds of a fresh Python.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compress.cli import app
from compress.checkpoints.integrity import verify
from compress.checkpoints.output import OutputDir
from compress.errors import CompressError
from conftest import CALIB_TEXT

PRELOAD = ["child_helpers", "torch", "transformers", "gguf", "accelerate", "compress.cli.app", "compress.run.runner",
           "compress.engine.methods", "compress.export.gguf", "transformers.models.llama.modeling_llama"]


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    """``start(argv, log, slow_writes=0) -> Process`` running ``compress ARGV`` in a forked child."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    from child_helpers import run_cli

    def start(argv: list, log: Path, slow_writes: float = 0.0):
        process = context.Process(target=run_cli, args=([str(a) for a in argv], str(log), slow_writes))
        process.start()
        return process

    warm = start(["--version"], tmp_path_factory.mktemp("forkserver") / "version.txt")  # the server imports PRELOAD once
    warm.join(600)
    assert warm.exitcode == 0
    return start


def _digests(path: Path) -> dict[str, str]:
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def _weights(digests: dict[str, str]) -> dict[str, str]:
    """The weight files' digests (whole outputs differ where a log records speed: distillation's)."""
    return {name: digest for name, digest in digests.items() if name.endswith((".safetensors", ".gguf"))}


def _wait_for(pattern: str, folder: Path, process, timeout: float = 120.0) -> bool:
    """True once a file matching ``pattern`` exists in ``folder`` (False: the process ended first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(folder.glob(pattern)):
            return True
        if not process.is_alive():
            return False
        time.sleep(0.01)
    raise AssertionError(f"no {pattern} in {folder} after {timeout} s")


def _leftovers(folder: Path, name: str) -> list[str]:
    """Temporary files of writers of ``name`` in ``folder`` (the lock file of a killed run excepted)."""
    return sorted(p.name for p in folder.glob(f".{name}.*") if not p.name.endswith(".lock"))


# -- a full disk ----------------------------------------------------------------------------------------
def _no_space(after: int):
    calls = {"n": 0}

    def fail(*_args, **_kwargs):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "shard-00000.data")

    return fail


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tiny_llama, monkeypatch):
    from compress.checkpoints.shards import ShardedWriter

    before = _digests(tiny_llama)
    add, fail = ShardedWriter.add, _no_space(after=5)
    monkeypatch.setattr(ShardedWriter, "add", lambda self, name, tensor: (fail(), add(self, name, tensor)))
    out = tmp_path / "out"
    done = CliRunner().invoke(app, ["quantize", str(tiny_llama), "-o", str(out), "--group-size", "32", "--json"])
    assert done.exit_code == 2, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and "nothing was written" in lines[0], done.output
    assert not out.exists() and os.listdir(tmp_path) == []  # no output, no temporary directory, no lock
    assert _digests(tiny_llama) == before


def test_a_full_disk_during_a_gguf_export(tmp_path, tiny_llama, monkeypatch):
    import gguf

    before = _digests(tiny_llama)
    write, fail = gguf.GGUFWriter.write_tensor_data, _no_space(after=3)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", lambda self, *a, **k: (fail(), write(self, *a, **k)))
    out = tmp_path / "model.gguf"
    done = CliRunner().invoke(app, ["export", str(tiny_llama), "-o", str(out), "--type", "q8_0", "--json"])
    assert done.exit_code == 2 and "No space left on device" in done.output and len(done.output.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []
    assert _digests(tiny_llama) == before


# -- SIGINT, SIGTERM ------------------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_run_and_cleans_up(tmp_path, tiny_llama, forked, signum):
    before = _digests(tiny_llama)
    out, log = tmp_path / "out", tmp_path / "log.txt"
    child = forked(["quantize", tiny_llama, "-o", out, "--group-size", "32"], log, slow_writes=0.2)
    assert _wait_for(".out.partial-*", tmp_path, child), log.read_text()
    os.kill(child.pid, signum)
    child.join(60)
    text = log.read_text().strip()
    assert child.exitcode == 128 + signum, text
    # layers that finished before the signal are reported as they finish (and the progress display ends a line)
    *finished, last = [line for line in text.splitlines() if line.strip()]
    assert last == f"interrupted by {signal.Signals(signum).name}: stopped; the partial output was removed, nothing was written"
    assert all(line.lstrip().startswith("model.layers.") for line in finished), text
    assert sorted(os.listdir(tmp_path)) == ["log.txt"]
    assert _digests(tiny_llama) == before


# -- SIGKILL at random points ---------------------------------------------------------------------------
def _commands(tiny_llama: Path, out: Path) -> dict[str, list]:
    calib = ["--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "32"]
    return {
        "quantize": ["quantize", tiny_llama, "-o", out, "--method", "gptq", "--group-size", "32", *calib, "--overwrite"],
        "prune": ["prune", tiny_llama, "-o", out, "--method", "wanda", "--sparsity", "0.5", *calib, "--overwrite"],
        "export": ["export", tiny_llama, "-o", out.with_suffix(".gguf"), "--type", "q4_0", "--overwrite"],
        "distill": ["distill", tiny_llama, "-o", out, "--student", "layers:0", "--data", CALIB_TEXT, "--steps", "3",
                    "--batch-size", "2", "--seq-len", "32", "--overwrite"],
    }


@pytest.mark.parametrize("command", ["quantize", "prune", "export", "distill"])
def test_sigkill_never_leaves_a_partial_output(tmp_path, tiny_llama, forked, command):
    """Killed at random points (seeded), the output path holds nothing or a complete output; the next run
    names each temporary file the killed ones left, with the command to remove it, and finishes."""
    argv = _commands(tiny_llama, tmp_path / "out")[command]
    final = Path(argv[argv.index("-o") + 1])
    rng = random.Random(f"{command}-20")
    start = time.monotonic()
    full = forked(argv, tmp_path / "full.txt")
    full.join(300)
    seconds = time.monotonic() - start
    assert full.exitcode == 0, (tmp_path / "full.txt").read_text()
    complete = _weights(_digests(final))
    for seed in range(2):
        child = forked(argv, tmp_path / f"killed-{seed}.txt")
        time.sleep(rng.uniform(0.0, seconds))
        child.kill()
        child.join(60)
        if final.exists():  # the first run's complete output, or this one's if it was killed after its rename
            verify(final)  # complete: every file and tensor as its manifest says
            assert _weights(_digests(final)) == complete
    left = _leftovers(tmp_path, final.name)
    rerun = forked(argv, tmp_path / "rerun.txt")
    rerun.join(300)
    report = (tmp_path / "rerun.txt").read_text()
    assert rerun.exitcode == 0, report
    for name in left:
        assert f"{tmp_path / name} was left by an interrupted run" in report and f"rm -rf {tmp_path / name}" in report
        assert not (tmp_path / name).exists()  # superseded by the rerun's complete output
    verify(final)
    assert _weights(_digests(final)) == complete
    print(f"{command}: a complete run took {seconds:.1f} s; killed runs left {left or 'nothing'}")


def test_a_kill_while_writing_is_reported_by_the_next_run(tmp_path, tiny_llama, forked):
    argv = ["quantize", tiny_llama, "-o", tmp_path / "out", "--group-size", "32"]
    child = forked(argv, tmp_path / "killed.txt", slow_writes=0.2)
    assert _wait_for(".out.partial-*", tmp_path, child)
    child.kill()
    child.join(60)
    assert not (tmp_path / "out").exists()
    stale = tmp_path / f".out.partial-{child.pid}"
    assert stale.is_dir()
    rerun = forked(argv, tmp_path / "rerun.txt")
    rerun.join(300)
    report = (tmp_path / "rerun.txt").read_text()
    assert rerun.exitcode == 0 and f"rm -rf {stale}" in report, report
    assert not stale.exists() and f"superseded by this one: {stale.name}" in " ".join(report.split()), report
    verify(tmp_path / "out")


# -- SIGKILL, then --resume ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory, tiny_tokenizer) -> Path:
    from conftest import save_random_model, tiny_llama_config

    return save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=4), tmp_path_factory.mktemp("four") / "m", tiny_tokenizer)


def _recorded_block(directory: Path) -> int:
    """The last block the run in ``directory`` recorded as written (-1: none yet)."""
    try:
        return json.loads((directory / ".progress" / "progress.json").read_text())["block"]
    except (OSError, ValueError):
        return -1


@pytest.mark.parametrize("seed", [2, 5])  # killed in block 3 and in block 1
def test_a_gptq_run_killed_at_a_random_block_resumes_to_the_same_bytes(tmp_path, four_blocks, forked, seed):
    """SIGKILL once block k's progress record is there (k and the delay after it drawn from the seed; tensors are
    written slowly, so the kill falls while the next block computes or writes), then the same command with
    --resume: the output equals an uninterrupted run's file for file, and nothing is left beside it."""
    out = tmp_path / "out"
    argv = ["quantize", four_blocks, "-o", out, "--method", "gptq", "--group-size", "32",
            "--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "32"]
    full = forked(argv, tmp_path / "full.txt")
    full.join(300)
    assert full.exitcode == 0, (tmp_path / "full.txt").read_text()
    complete = _digests(out)
    shutil.rmtree(out)
    rng = random.Random(f"resume-{seed}")
    block, delay = rng.randrange(3), rng.uniform(0.0, 0.3)
    child = forked(argv, tmp_path / "killed.txt", slow_writes=0.05)
    partial = tmp_path / f".out.partial-{child.pid}"
    deadline = time.monotonic() + 120
    while _recorded_block(partial) < block:
        assert child.is_alive() and time.monotonic() < deadline, (tmp_path / "killed.txt").read_text()
        time.sleep(0.005)
    time.sleep(delay)
    child.kill()
    child.join(60)
    assert not out.exists() and partial.is_dir(), "the run ended before the kill"
    killed_at = _recorded_block(partial)
    resumed = forked([*argv, "--resume"], tmp_path / "resumed.txt")
    resumed.join(300)
    report = (tmp_path / "resumed.txt").read_text()
    assert resumed.exitcode == 0, report
    assert "was left by an interrupted run" not in report, report
    assert _digests(out) == complete
    assert _leftovers(tmp_path, "out") == []
    print(f"seed {seed}: killed {delay:.2f} s after block {block}'s record, with blocks up to {killed_at} written; resumed")


def test_a_run_killed_after_finishing_a_shard_resumes_to_the_same_bytes(tmp_path, tiny_tokenizer, forked):
    """Dense 2.4 MB blocks in 1 MB shards: the run is killed once a shard is finished after the last progress
    record, whose shard was then still open (the header written into its room and the next shard begun): --resume
    cuts the shard back to the record, drops the newer shard and ends with an uninterrupted run's bytes."""
    from conftest import save_random_model, tiny_llama_config

    model = save_random_model(tiny_llama_config(len(tiny_tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=3),
                              tmp_path / "m", tiny_tokenizer)
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {model}\ncalibration: {{path: {CALIB_TEXT}, samples: 4, seq_len: 32}}\n"
                      f"stages:\n  - method: gptq\n    group_size: 32\noutput: {{path: {out}, format: fake, shard_size_mb: 1}}\n")
    full = forked(["run", recipe], tmp_path / "full.txt")
    full.join(300)
    assert full.exitcode == 0, (tmp_path / "full.txt").read_text()
    complete = _digests(out)
    shutil.rmtree(out)
    child = forked(["run", recipe], tmp_path / "killed.txt", slow_writes=0.05)
    partial = tmp_path / f".out.partial-{child.pid}"
    deadline = time.monotonic() + 120

    def shard_finished_after_the_record() -> bool:
        try:
            writer = json.loads((partial / ".progress" / "progress.json").read_text())["writer"]
        except (OSError, ValueError):
            return False
        return bool(writer["entries"]) and (partial / f"shard-{len(writer['shards']) + 1:05d}.tmp").exists()  # the next one begun

    while not shard_finished_after_the_record():
        assert child.is_alive() and time.monotonic() < deadline, (tmp_path / "killed.txt").read_text()
        time.sleep(0.005)
    child.kill()
    child.join(60)
    assert not out.exists()
    resumed = forked(["run", recipe, "--resume"], tmp_path / "resumed.txt")
    resumed.join(300)
    assert resumed.exitcode == 0, (tmp_path / "resumed.txt").read_text()
    assert _digests(out) == complete and len([n for n in complete if n.endswith(".safetensors")]) > 3


def test_without_resume_a_killed_run_is_reported_with_the_resume_command(tmp_path, tiny_llama, forked):
    argv = ["quantize", tiny_llama, "-o", tmp_path / "out", "--method", "gptq", "--group-size", "32",
            "--calib", CALIB_TEXT, "--samples", "4", "--seq-len", "32"]
    child = forked(argv, tmp_path / "killed.txt", slow_writes=0.05)
    partial = tmp_path / f".out.partial-{child.pid}"
    deadline = time.monotonic() + 120
    while _recorded_block(partial) < 0:
        assert child.is_alive() and time.monotonic() < deadline, (tmp_path / "killed.txt").read_text()
        time.sleep(0.005)
    child.kill()
    child.join(60)
    rerun = forked(argv, tmp_path / "rerun.txt")
    rerun.join(300)
    report = (tmp_path / "rerun.txt").read_text()
    assert rerun.exitcode == 0, report
    assert (f"{partial} was left by an interrupted run and is not used; continue it with the same command and --resume, "
            f"or remove it with: rm -rf {partial}") in " ".join(report.split()), report
    assert not partial.exists()  # reported, never reused, and removed once the new run's output is complete
    verify(tmp_path / "out")


# -- two runs, one output -------------------------------------------------------------------------------
def test_two_runs_writing_the_same_output(tmp_path, tiny_llama, forked):
    argv = ["quantize", tiny_llama, "-o", tmp_path / "out", "--group-size", "32"]
    runs = [forked(argv, tmp_path / f"run-{i}.txt", slow_writes=0.1) for i in range(2)]
    for run in runs:
        run.join(300)
    codes = sorted(run.exitcode for run in runs)
    logs = [(tmp_path / f"run-{i}.txt").read_text().strip() for i in range(2)]
    assert codes == [0, 2], logs
    loser = logs[[run.exitcode for run in runs].index(2)]
    assert len(loser.splitlines()) == 1 and ("another run" in loser or "already exists" in loser), loser
    verify(tmp_path / "out")  # one complete output, every file and tensor as its manifest says


def test_the_output_lock_refuses_a_second_writer(tmp_path):
    with OutputDir(tmp_path / "out") as first:
        (first / "a").write_text("first")
        with pytest.raises(CompressError, match=rf"another run \(pid {os.getpid()}\) is writing .*out: wait for it"):
            with OutputDir(tmp_path / "out", overwrite=True):
                pass
    assert (tmp_path / "out" / "a").read_text() == "first" and sorted(os.listdir(tmp_path)) == ["out"]
