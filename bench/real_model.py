"""A quality table on one model: each row a `compress run` in its own process, with its wall time and peak RSS.

    python bench/real_model.py --model DIR [--rows quant,smoothquant,pruning | LABEL,...] [--seeds 0,1,2]
        [--calib eval/assets/shakespeare-calib-slice.txt --samples 32 --seq-len 512]
        [--text eval/assets/shakespeare-test-slice.txt --ctx 512 --max-tokens 4096] [--json PATH]

Each row is a recipe (its stages below) run as ``python -m compress.cli run RECIPE``: the code path users
take, one process per row, so the peak RSS is that run's own (its VmHWM) and the wall time includes
loading and writing. Each output is then scored against the model by `evaluate_outputs` (perplexity and
mean per-token KLD on the held-out text) and removed. With several ``--seeds`` (the calibration windows'
sampling seed) every row runs once per seed and the table shows the mean KLD and its range: on a small
truncated model a setting's effect must exceed the seed-to-seed spread before it means anything.

Where both rows of an ordering ran (`ORDERINGS`: the quality orderings the tests check on the shipped reference
model, tests/eval/test_*_quality.py), the table ends with whether this model shows it too (exit status 1 if not):
on SmolLM2-135M, ``--rows quant,pruning``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from compress.eval.report import Protocol, evaluate_outputs
from quality import quality_parser  # bench/ is the script's folder


def _quant(method: str, bits: int, group: int, **options) -> list[dict]:
    return [{"method": method, "bits": bits, "group_size": group, **options}]


QUANT = {f"{m} w{b} {'per-chan' if g == -1 else f'g{g}'}": _quant(m, b, g)
         for m in ("rtn", "gptq", "awq") for b, g in ((4, 64), (3, 64), (4, -1))}
SMOOTHQUANT = {f"smoothquant w8a8 {a}": [{"method": "smoothquant", "activations": a}] for a in ("token", "tensor")}
PRUNING = {f"{m} {label}": [{"method": m, **spec}] for m in ("magnitude", "wanda", "sparsegpt")
           for label, spec in (("50%", {"sparsity": 0.5}), ("2:4", {"pattern": "2:4"}))}
# Item 3 of the real-models issue: each default next to its alternatives (w4 g64).
DEFAULTS = {
    "gptq (default)": _quant("gptq", 4, 64),
    "gptq act_order=false": _quant("gptq", 4, 64, act_order=False),
    "gptq mse=false": _quant("gptq", 4, 64, mse=False),
    "gptq damp=0.1": _quant("gptq", 4, 64, damp=0.1),
    "gptq damp=0.001": _quant("gptq", 4, 64, damp=0.001),
    "awq (default)": _quant("awq", 4, 64),
    "awq duo_scaling=true": _quant("awq", 4, 64, duo_scaling=True),
    "smoothquant alpha=0.8 (default)": [{"method": "smoothquant"}],
    "smoothquant alpha=0.3": [{"method": "smoothquant", "alpha": 0.3}],
    "smoothquant alpha=0.5": [{"method": "smoothquant", "alpha": 0.5}],
    "smoothquant alpha=0.7": [{"method": "smoothquant", "alpha": 0.7}],
    **{f"smoothquant tensor alpha={a}": [{"method": "smoothquant", "activations": "tensor", "alpha": a}] for a in (0.5, 0.7, 0.8)},
}
# (row, at most this multiple of, row): each method against the one it must beat, on the mean KLD over the seeds
ORDERINGS = [("gptq w3 g64", 0.6, "rtn w3 g64"), ("awq w4 g64", 1.0, "rtn w4 g64"), ("sparsegpt 50%", 0.5, "magnitude 50%")]
GROUPS = {"quant": QUANT, "smoothquant": SMOOTHQUANT, "pruning": PRUNING, "defaults": DEFAULTS}
ROWS = {label: stages for group in GROUPS.values() for label, stages in group.items()}


def needs_calibration(stages: list[dict]) -> bool:
    from compress.engine.registry import method_class

    for stage in stages:
        cls = method_class(stage["method"])
        if cls(cls.Config(**{k: v for k, v in stage.items() if k != "method"})).needs:
            return True
    return False


def run_row(stages: list[dict], model: Path, out: Path, calibration: dict, threads: int) -> tuple[float, float]:
    """Run one recipe in a child process; (wall seconds, peak RSS in GB) of that process."""
    recipe = {"model": str(model), "stages": stages, "output": {"path": str(out), "overwrite": True}}
    if needs_calibration(stages):
        recipe["calibration"] = calibration
    path = out.parent / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    # The child records its own peak (VmHWM) as it exits: a child's ru_maxrss would include this process's
    # memory at the fork, which after the first evaluation is larger than a quantization run's.
    peak = out.parent / "peak-rss"
    record = (f"import atexit, runpy, sys; atexit.register(lambda: open({str(peak)!r}, 'w').write("
              "next(l for l in open('/proc/self/status') if l.startswith('VmHWM')))); "
              f"sys.argv = ['compress', 'run', {str(path)!r}]; runpy.run_module('compress.cli', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", record], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"compress run failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    return seconds, int(peak.read_text().split()[1]) / 2**20  # VmHWM: "VmHWM:  123456 kB"


def main() -> None:
    ap = quality_parser(__doc__)
    ap.add_argument("--rows", default="quant,smoothquant,pruning", help=f"groups ({', '.join(GROUPS)}) or row labels")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    labels = [label for item in args.rows.split(",") for label in (GROUPS[item] if item in GROUPS else [item])]
    unknown = [label for label in labels if label not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known groups: {', '.join(GROUPS)}; rows: {', '.join(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    protocol = Protocol(args.text, ctx=args.ctx, max_tokens=args.max_tokens)
    print(f"model {args.model}; calibration {args.calib.name} {args.samples}x{args.seq_len} seeds {seeds}; "
          f"text {args.text.name} ctx {args.ctx} max {args.max_tokens} tokens; {args.threads} threads", flush=True)
    print(f"{'row':<34}{'seed':>5}{'ppl':>11}{'ref ppl':>11}{'mean KLD':>10}{'sparsity':>9}{'wall s':>8}{'RSS GB':>8}",
          flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in labels:
            for seed in seeds:
                out = Path(tmp) / "out"
                calibration = {"path": str(args.calib), "samples": args.samples, "seq_len": args.seq_len, "seed": seed}
                seconds, rss = run_row(ROWS[label], args.model, out, calibration, args.threads)
                report = evaluate_outputs([out], args.model, protocol)
                row = report.rows[0]
                results.append({"row": label, "seed": seed, "perplexity": row.perplexity,
                                "ref_perplexity": report.baseline.perplexity, "kld": row.kld,
                                "sparsity": row.sparsity, "seconds": round(seconds, 1), "peak_rss_gb": round(rss, 3)})
                sparsity = f"{row.sparsity:.3f}" if row.sparsity else "-"
                print(f"{label:<34}{seed:>5}{row.perplexity:>11.4g}{report.baseline.perplexity:>11.4g}{row.kld:>10.5f}"
                      f"{sparsity:>9}{seconds:>8.1f}{rss:>8.2f}", flush=True)
                shutil.rmtree(out)
    if len(seeds) > 1:
        print(f"\n{'row':<34}{'mean KLD':>10}{'min':>10}{'max':>10}")
        for label in labels:
            klds = [r["kld"] for r in results if r["row"] == label]
            print(f"{label:<34}{sum(klds) / len(klds):>10.5f}{min(klds):>10.5f}{max(klds):>10.5f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not orderings_hold(results):
        raise SystemExit(1)


def orderings_hold(results: list[dict]) -> bool:
    """Print each of `ORDERINGS` whose two rows ran, and whether it holds (a strict ``<`` at a multiple of 1)."""
    mean = {}
    for label in {r["row"] for r in results}:
        klds = [r["kld"] for r in results if r["row"] == label]
        mean[label] = sum(klds) / len(klds)
    held = True
    for row, factor, other in ORDERINGS:
        if row in mean and other in mean:
            ok = mean[row] < mean[other] if factor == 1.0 else mean[row] <= factor * mean[other]
            held &= ok
            print(f"{row} KLD {mean[row]:.5f} {'<' if factor == 1.0 else '<='} {factor:g} x {other} {mean[other]:.5f}: "
                  f"{'holds' if ok else 'FAILS'}")
    return held


if __name__ == "__main__":
    main()
