"""One method with 1 and with N processes (torchrun, gloo on CPUs), its wall time split into phases.

    python bench/distributed.py [--model DIR | --width 1024 --blocks 8] [--method gptq|rtn|awq|sparsegpt|wanda]
                                [-O KEY=VALUE ...] [--ranks 2] [--samples 32 --seq-len 512] [--threads-per-rank 1]

Without ``--model`` it compresses a random Llama of ``--blocks`` blocks of width ``--width`` (MLP 2.75x rounded to 128, 16
heads, 4 KV heads), where the solves matter. ``-O``: the method's settings, as ``compress quantize -O`` (e.g.
``-O true_sequential=false``). Each run starts ``torchrun --nproc-per-node P`` on this file
(``--worker``) with ``OMP_NUM_THREADS`` = threads per rank (1 by default: 2 ranks on 2 cores use them both);
each rank times its phases (exclusive wall time, `bench/pipeline.py`'s clock): ``capture`` (block 0's
inputs of its windows), ``order``, ``statistics`` (its forward passes), ``one pass`` (true-sequential methods where the
windows fit one batch: statistics, solves and propagation in one forward pass, `compress.engine.one_pass`), ``sums``
(inside either: the layers' input statistics added up, mostly Gram products), ``reduce`` (statistics summed over the
ranks), ``solve`` (its share of the layers), ``exchange`` (the solved layers' weights, codes and reports sent
to every rank: includes waiting for the slowest rank's solve), ``replay``, ``propagation``, ``write`` (rank 0
only). Printed: a table per process count (rank 0, and the largest figure over ranks), each run's wall time
from launch to exit and the speed-up; the outputs of both runs are compared tensor by tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
PHASES = ("load", "capture", "order", "statistics", "one pass", "sums", "reduce", "solve", "exchange", "replay", "propagation", "write")
STAGES = {
    "gptq": {"method": "gptq", "bits": 4, "group_size": 128},
    "rtn": {"method": "rtn", "bits": 4, "group_size": 128},
    "awq": {"method": "awq", "bits": 4, "group_size": 128},
    "sparsegpt": {"method": "sparsegpt", "sparsity": 0.5},
    "wanda": {"method": "wanda", "sparsity": 0.5},
}


def worker(args) -> None:
    """One rank: the recipe, timed by phase; its figures to ``--report``.rank<N>.json."""
    from pipeline import PhaseClock, instrument

    from compress.cli.options import parse_options
    from compress.engine import block_engine
    from compress.engine.ranks import Ranks
    from compress.engine.statistics import StatsCollector
    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe

    clock = PhaseClock()
    instrument(clock)
    clock.wrap(StatsCollector, "combine", "reduce")
    for attribute in ("gather", "broadcast_"):
        clock.wrap(Ranks, attribute, "exchange")
    clock.wrap(block_engine.Engine, "_write_outer", "write")
    recipe = {
        "model": args.model, "stages": [{**STAGES[args.method], **parse_options(args.option)}],
        "calibration": {"path": args.calib, "samples": args.samples, "seq_len": args.seq_len},
        "output": {"path": args.out, "format": "compressed-tensors"},
    }
    start = time.perf_counter()
    run_recipe(parse_recipe(recipe))
    seconds = time.perf_counter() - start
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{args.report}.rank{rank}.json").write_text(json.dumps({"seconds": seconds, "phases": dict(clock.seconds)}))


def random_model(width: int, blocks: int, directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(REPO / "eval/assets/reference-llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=(width * 11 // 4 + 127) // 128 * 128, num_hidden_layers=blocks,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def launch(args, model: Path, ranks: int, scratch: Path) -> tuple[float, list[dict], Path]:
    out, report = scratch / f"out-{ranks}", scratch / f"report-{ranks}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), __file__, "--worker",
               "--model", str(model), "--method", args.method, "--calib", str(args.calib), "--samples", str(args.samples),
               "--seq-len", str(args.seq_len), "--out", str(out), "--report", str(report), *(f"-O{o}" for o in args.option)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_rank), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return wall, [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in range(ranks)], out


def differing_tensors(a: Path, b: Path) -> int:
    import torch
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    x, y = tensors(a), tensors(b)
    return sum(not torch.equal(x[k], y[k]) for k in x) + len(set(x) ^ set(y))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--method", choices=sorted(STAGES), default="gptq")
    ap.add_argument("-O", "--option", action="append", default=[], help="method setting KEY=VALUE")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--calib", type=Path, default=REPO / "eval/assets/shakespeare-calib-slice.txt")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = args.model or random_model(args.width, args.blocks, scratch / f"random-llama-{args.width}x{args.blocks}")
        print(f"model {model.name}, {args.method} {' '.join(args.option)}, calibration {args.samples} x {args.seq_len}, "
              f"{args.threads_per_rank} thread(s) per rank, gloo")
        runs = {n: launch(args, model, n, scratch) for n in (1, args.ranks)}
        for n, (wall, reports, _) in runs.items():
            print(f"\n{n} process(es): wall {wall:.1f} s from launch to exit, {reports[0]['seconds']:.1f} s in the run"
                  f"\n\n| phase | rank 0 s | max over ranks s |\n|---|---:|---:|")
            for phase in PHASES:
                figures = [r["phases"].get(phase, 0.0) for r in reports]
                if any(figures):
                    print(f"| {phase} | {figures[0]:.2f} | {max(figures):.2f} |")
        (one, _, out1), (many, _, out_n) = runs[1], runs[args.ranks]
        print(f"\nspeed-up with {args.ranks} processes: {one / many:.2f}x end to end "
              f"({runs[1][1][0]['seconds'] / runs[args.ranks][1][0]['seconds']:.2f}x in the run); "
              f"tensors differing from the 1-process output: {differing_tensors(out1, out_n)}")


if __name__ == "__main__":
    main()
