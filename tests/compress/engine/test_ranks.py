"""Many processes on one engine: 2 gloo processes under torchrun give the output of one process."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from compress.cli.app import app
from compress.engine.ranks import Ranks, plan_shares
from conftest import CALIB_TEXT, REFERENCE_MODEL, checkpoint_tensors

CALIB = ["--calib", str(CALIB_TEXT), "--samples", "6", "--seq-len", "96"]
CASES = {
    "rtn": ["quantize", "--method", "rtn"],
    "gptq+kv-int8": ["quantize", "--method", "gptq", "--kv-cache", "int8", *CALIB],
    # static input scales: learned state of layers solved whole on the other rank, in one process's order
    "gptq-w8a8-static": ["quantize", "--method", "gptq", "--bits", "8", "--group-size", "-1", "-O", "activations=int8-tensor", *CALIB],
    # the scale search on 2 of the 6 windows (one per rank): the windows one process picks
    "awq": ["quantize", "--method", "awq", "-O", "search_tokens=192", *CALIB],
    "smoothquant": ["quantize", "--method", "smoothquant", *CALIB],
    "sparsegpt": ["prune", "--method", "sparsegpt", "--sparsity", "0.5", *CALIB],
    "sparsegpt-2:4-w4": ["prune", "--method", "sparsegpt", "--pattern", "2:4", "-O", "bits=4", *CALIB],  # rows split
    "wanda-2:4": ["prune", "--method", "wanda", "--pattern", "2:4", *CALIB],
    "gguf-gptq": ["export", "--type", "q4_k_m", "--method", "gptq", *CALIB],
    "gguf-gptq-asymmetric": ["export", "--type", "q4_k", "--method", "gptq", "-O", "asymmetric=true", *CALIB],
    "imatrix": ["imatrix", *CALIB],
    # a block's windows split over the ranks: each step's gradients all-reduced (4 of the 6 windows a step)
    "autoround": ["quantize", "--method", "autoround", "--bits", "3", "-O", "iters=4", "-O", "batch_size=4", *CALIB],
    "gguf-autoround": ["export", "--type", "q4_k_m", "--method", "autoround", "-O", "iters=8", "-O", "batch_size=4",
                       *CALIB],
}
FILE_OUTPUTS = {"export", "imatrix"}  # one GGUF file, compared byte for byte


# -- one process: the collectives are identities --------------------------------------------------------
def test_one_process_shares_nothing():
    ranks, x = Ranks(), torch.arange(40.0).reshape(20, 2)
    assert ranks.main and ranks.local_share(x) is x
    assert ranks.sum_floats(1.5, 2.0) == [1.5, 2.0]
    for count in (1, 3, 7, 20, 50):
        assert torch.equal(ranks.strided_rows(x, count), x[:: max(1, 20 // count)][:count])


def test_the_launched_main_rank_is_known_from_the_launchers_environment(monkeypatch):
    """What torchrun sets (WORLD_SIZE, RANK): rank 0 of a launch, or a process alone, will write."""
    for world, rank, main in ((None, None, True), ("1", None, True), ("2", "0", True), ("2", "1", False), ("4", "3", False)):
        for name, value in (("WORLD_SIZE", world), ("RANK", rank)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert Ranks.launched_main() is main, (world, rank)


def test_jobs_are_balanced_within_grahams_bound():
    """Longest-processing-time-first is within 4/3 - 1/(3m) of the best makespan (Graham 1969); checked
    against every assignment of small random job sets."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        world = 2 + trial % 2
        costs = {f"layer{i}": float(c) for i, c in enumerate(torch.randint(1, 100, (6,), generator=gen))}
        owner = Ranks(0, world).assign(costs)
        assert set(owner) == set(costs) and set(owner.values()) <= set(range(world))
        makespan = max(sum(c for n, c in costs.items() if owner[n] == r) for r in range(world))
        best = min(
            max(sum(c for c, r in zip(costs.values(), choice) if r == rank) for rank in range(world))
            for choice in itertools.product(range(world), repeat=len(costs))
        )
        assert makespan <= (4 / 3 - 1 / (3 * world)) * best + 1e-9


def test_layers_too_large_for_an_even_share_are_split_by_rows():
    """A layer costing more than half a group's solve (rows x columns²) is split over 2 ranks; the others go
    whole, balanced: q/k/v split q and give k, v one rank each; gate/up go one each; a lone down_proj is split."""
    def linears(**shapes):
        return {name: torch.nn.Linear(cols, rows, bias=False, device="meta") for name, (rows, cols) in shapes.items()}

    ranks = Ranks(rank=0, world=2)
    assert plan_shares(ranks, linears(q=(1024, 1024), k=(256, 1024), v=(256, 1024))) == {"q": None, "k": 0, "v": 1}
    assert plan_shares(ranks, linears(gate=(2816, 1024), up=(2816, 1024))) == {"gate": 0, "up": 1}
    assert plan_shares(ranks, linears(down=(1024, 2816))) == {"down": None}
    assert plan_shares(ranks, linears(tiny=(1, 64))) == {"tiny": 0}  # fewer rows than ranks: whole
    assert plan_shares(Ranks(), linears(q=(1024, 1024), k=(256, 1024))) == {"q": 0, "k": 0}


def test_windows_are_shared_in_order():
    windows = torch.arange(7).reshape(7, 1)
    shares = [Ranks(r, 3).local_share(windows) for r in range(3)]
    assert torch.equal(torch.cat(shares), windows) and [len(s) for s in shares] == [3, 2, 2]


# -- two processes ---------------------------------------------------------------------------------------
def _gguf_contents(path: Path) -> tuple[dict, dict]:
    """Every metadata value (the run record without its command line) and every tensor's bytes."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {name: [bytes(part) for part in field.parts] for name, field in reader.fields.items()}
    if "llm_compress.record" in reader.fields:
        record = json.loads(reader.fields["llm_compress.record"].contents())
        record.pop("command")
        fields["llm_compress.record"] = record
    return fields, {t.name: t.data.tobytes() for t in reader.tensors}


def _config(directory: Path) -> dict:
    config = json.loads((directory / "config.json").read_text())
    config["compression"].pop("command")  # the launcher's command line differs
    return config


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_write_what_one_process_writes(tmp_path, case):
    _compare_one_and_two(CASES[case], REFERENCE_MODEL, tmp_path)


def test_two_processes_share_moe_experts(tmp_path, tiny_tokenizer):
    """Qwen2-MoE (4 routed experts and a shared one per block): the experts are solved on both ranks and
    their routed-token counts summed."""
    from architectures import save_architecture

    model = save_architecture("qwen2_moe", tmp_path / "qwen2-moe", tiny_tokenizer)
    _compare_one_and_two(["quantize", "--method", "gptq", "--group-size", "32", *CALIB], model, tmp_path)


def test_two_processes_collect_one_moe_imatrix(tmp_path, tiny_tokenizer):
    """MoE importance matrices (one row and one count per expert) summed over 2 processes' windows: the file
    one process writes."""
    from architectures import save_architecture

    model = save_architecture("mixtral", tmp_path / "mixtral", tiny_tokenizer)
    _compare_one_and_two(["imatrix", *CALIB], model, tmp_path)


def _close_floats(info: dict) -> dict:
    """``info`` with its floats compared up to float32 rounding: a layer whose rows the ranks split sums its
    proxy error from the slices' products (every other figure, and every tensor, compares exactly)."""
    return {k: pytest.approx(v, rel=1e-6) if isinstance(v, float) else v for k, v in info.items()}


def _compare_one_and_two(argv: list[str], model: Path, tmp_path: Path) -> None:
    suffix = ".gguf" if argv[0] in FILE_OUTPUTS else ""
    one, two = tmp_path / f"one{suffix}", tmp_path / f"two{suffix}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (torchrun's default): the reference differs only in its process count
    try:
        done = CliRunner().invoke(app, [argv[0], str(model), "-o", str(one), *argv[1:], "--json"])
    finally:
        torch.set_num_threads(threads)
    assert done.exit_code == 0, done.output
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "compress.cli", argv[0], str(model), "-o", str(two), *argv[1:], "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert launched.returncode == 0, launched.stdout + launched.stderr
    summary = json.loads(launched.stdout)  # rank 0's summary alone
    assert summary["output"] == str(two)
    if suffix:
        assert _gguf_contents(two) == _gguf_contents(one)
        return
    assert summary["layers"] == [{**layer, "seconds": summary_layer["seconds"], "info": _close_floats(layer["info"])}
                                 for layer, summary_layer in zip(json.loads(done.output)["layers"], summary["layers"])]
    assert _config(two) == _config(one)
    a, b = checkpoint_tensors(one), checkpoint_tensors(two)
    assert a.keys() == b.keys()
    differing = {name: int((a[name] != b[name]).sum()) for name in a if not torch.equal(a[name], b[name])}
    assert not differing, f"{len(differing)} tensors differ: {differing}"


def test_more_processes_than_windows_is_refused(tmp_path):
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "compress.cli", "quantize", str(REFERENCE_MODEL), "-o", str(tmp_path / "out"), "--method", "gptq",
         "--calib", str(CALIB_TEXT), "--samples", "1", "--seq-len", "64"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
    )
    assert launched.returncode != 0
    assert "1 calibration windows cannot be shared by 2 processes" in launched.stderr
    assert not (tmp_path / "out").exists()


def _strided_rows_on_rank(rank: int, init: str, counts: list[int], count: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(counts))
    ranks = Ranks(rank, len(counts))
    start = sum(counts[:rank])
    rows = torch.arange(start, start + counts[rank], dtype=torch.float32).unsqueeze(1)  # each row holds its global index
    picked = ranks.strided_rows(rows, count)
    if rank == 0:
        torch.save(picked, out)
    ranks.close()


@pytest.mark.parametrize("counts,count", [([7, 5], 4), ([5, 7], 5), ([3, 9], 12), ([6, 6], 100)])
def test_strided_rows_across_processes_are_the_rows_one_process_picks(tmp_path, counts, count):
    """AWQ's clipping samples: each rank sends only its rows on the global stride, and the gathered rows are
    the ones one process picks from all rows in order."""
    import torch.multiprocessing as mp

    out = tmp_path / "picked.pt"
    mp.start_processes(_strided_rows_on_rank, args=(f"file://{tmp_path / 'store'}", counts, count, str(out)),
                       nprocs=len(counts), start_method="spawn")
    everything = torch.arange(sum(counts), dtype=torch.float32).unsqueeze(1)
    assert torch.equal(torch.load(out), everything[:: max(1, sum(counts) // count)][:count])


def test_a_killed_two_process_run_resumes_to_the_one_process_bytes(tmp_path):
    """SIGKILL of a 2-process asymmetric GPTQ run (each process records its share of both input streams) once its
    first record exists (block 0's: the journal always records the first block, and later ones only where a record
    costs little beside the blocks' work, so which follow depends on the machine's speed): resuming with another
    process count is refused naming it; the same launch with --resume ends with the tensors and config one process
    writes."""
    import signal
    import time

    from compress.checkpoints.output import PROGRESS, PROGRESS_RECORD

    options = ["--method", "gptq", "-O", "asymmetric=true", "--calib", str(CALIB_TEXT), "--samples", "8", "--seq-len", "128"]
    one, two = tmp_path / "one", tmp_path / "two"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        done = CliRunner().invoke(app, ["quantize", str(REFERENCE_MODEL), "-o", str(one), *options])
    finally:
        torch.set_num_threads(threads)
    assert done.exit_code == 0, done.output
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "compress.cli", "quantize", str(REFERENCE_MODEL), "-o", str(two), *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(launch, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        records = list(tmp_path.glob(f".two.partial-*/{PROGRESS}/{PROGRESS_RECORD}"))
        if records:  # block 0 is recorded, 3 blocks of work remain
            job = _descendants(run.pid)  # the launcher and its workers (which it may start in sessions of their own)
            for pid in job:
                os.kill(pid, signal.SIGKILL)
            break
        assert run.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    run.wait()
    while any(Path(f"/proc/{pid}").exists() for pid in job) and time.monotonic() < deadline:
        time.sleep(0.05)  # the workers are reaped: their output lock is free
    assert not two.exists()
    refused = CliRunner().invoke(app, ["quantize", str(REFERENCE_MODEL), "-o", str(two), *options, "--resume"])
    assert refused.exit_code == 2 and "setting processes was 2, now 1" in refused.output, refused.output
    resumed = subprocess.run([*launch, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _config(two) == _config(one)
    a, b = checkpoint_tensors(one), checkpoint_tensors(two)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            queue += [int(c) for c in children]
    return found


def test_two_processes_smooth_inside_gptqs_pass(tmp_path):
    """SmoothQuant then GPTQ W8A8 (`recipes/smoothquant-gptq-w8a8.yaml`'s stages): the norms smoothed inside GPTQ's
    pass from every rank's windows, the output of one process."""
    import yaml

    def recipe(out: Path) -> Path:
        path = tmp_path / f"{out.name}.yaml"
        path.write_text(yaml.safe_dump({
            "model": str(REFERENCE_MODEL), "calibration": {"path": str(CALIB_TEXT), "samples": 6, "seq_len": 96},
            "stages": [{"method": "smoothquant", "quantize_weights": False},
                       {"method": "gptq", "scheme": "w8a8-int8", "group_size": -1}],
            "output": {"path": str(out)}}))
        return path

    one, two = tmp_path / "one", tmp_path / "two"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        done = CliRunner().invoke(app, ["run", str(recipe(one)), "--json"])
    finally:
        torch.set_num_threads(threads)
    assert done.exit_code == 0, done.output
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "compress.cli", "run", str(recipe(two)), "--json"],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
    )
    assert launched.returncode == 0, launched.stdout + launched.stderr
    a, b = checkpoint_tensors(one), checkpoint_tensors(two)
    assert a.keys() == b.keys()
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"{len(differing)} tensors differ: {differing[:3]}"
    assert any("norm" in name for name in a)
