"""Distillation quality on the reference model: does the teacher's soft signal beat plain cross-entropy?

Three claims, printed as one table (perplexity and mean KLD vs the teacher on held-out text):

1. A half-depth student (teacher layers kept, weights copied) distilled for a fixed budget reaches lower
   perplexity than the same student trained with cross-entropy only (alpha = 0) on the same windows,
   steps and learning-rate schedule.
2. A SparseGPT 2:4 model recovers perplexity when distilled from the dense model with its masks fixed,
   and every group of 4 weights in every block linear layer is still at most 2 non-zeros afterwards.

    python bench/distill_quality.py [--steps 50] [--train-text ../shared/corpus/shakespeare/train.txt]

Default settings: 938 s measured on 2 CPU cores shared with other work (load average ~7); less on idle cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus" / "shakespeare"


def _nm_ok(model_dir: Path) -> tuple[bool, int]:
    """Whether every decoder-block linear layer of the checkpoint is 2:4, and how many layers were checked."""
    from compress.distill.student import decoder_blocks
    from compress.checkpoints.loading import load_model
    from compress.checkpoints.model_io import get_weight, quantizable_layers
    from compress.pruners.masks import is_nm_sparse

    model = load_model(model_dir, torch.device("cpu"))
    name, blocks = decoder_blocks(model)
    layers = quantizable_layers(model, [f"{name}.{i}" for i in range(len(blocks))])
    return all(is_nm_sparse(get_weight(m), 2, 4) for m in layers.values()), len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, default=REPO / "eval" / "assets" / "reference-llama")
    parser.add_argument("--train-text", type=Path, default=CORPUS / "train.txt")
    parser.add_argument("--eval-text", type=Path, default=CORPUS / "test.txt")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="score the first N tokens of the eval text")
    parser.add_argument("--layers", default="0,2", help="teacher layers the half-depth student keeps")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--tau", type=float, default=2.0)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--skip-prune", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from compress.distill.config import DistillSpec, StudentSpec
    from compress.run.distill import run_distill, run_distill_recipe
    from compress.run.recipe import EvaluationSpec, OutputSpec, parse_recipe

    for path in (args.train_text, args.eval_text):
        if not path.is_file():
            sys.exit(f"error: {path} does not exist: pass --train-text/--eval-text")
    evaluation = EvaluationSpec(text=args.eval_text, ctx=512, max_tokens=args.eval_tokens)
    common = dict(data=args.train_text, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                  lr=args.lr, warmup_steps=max(1, args.steps // 10), tau=args.tau)
    layers = [int(i) for i in args.layers.split(",")]
    rows: list[tuple] = []

    def add(*row) -> None:  # printed as soon as known, so a failure later loses nothing
        rows.append(row)
        print(f"  row: {row}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        for label, alpha in ((f"half depth {layers}, distilled (alpha {args.alpha}, tau {args.tau})", args.alpha),
                             (f"half depth {layers}, cross-entropy only (alpha 0)", 0.0)):
            spec = DistillSpec(student=StudentSpec(layers=layers), alpha=alpha, **common)
            start = time.perf_counter()
            result = run_distill(args.teacher, spec, OutputSpec(path=Path(tmp) / f"a{alpha}"), evaluation)
            if not rows:
                add("teacher (4 layers)", "-", result.after.ref_perplexity, 0.0, "-")
                add(f"half depth {layers}, untrained", "0", result.before.perplexity, result.before.kld, "-")
            add(label, str(args.steps), result.after.perplexity, result.after.kld, f"{time.perf_counter() - start:.0f} s")
        if not args.skip_prune:
            out = Path(tmp) / "pruned-distilled"
            recipe = parse_recipe({
                "model": args.teacher,
                "calibration": {"path": REPO / "eval" / "assets" / "shakespeare-calib-slice.txt", "samples": 16, "seq_len": 512},
                "stages": [{"method": "sparsegpt", "pattern": "2:4"}],
                "output": {"path": out},
                "evaluation": evaluation.model_dump(),
                "distill": {**common, "alpha": args.alpha},
            }, "bench")
            start = time.perf_counter()
            result = run_distill_recipe(recipe)
            ok, checked = _nm_ok(out)
            add("SparseGPT 2:4", "0", result.before.perplexity, result.before.kld, "before distillation")
            add(f"SparseGPT 2:4, distilled, masks fixed (alpha {args.alpha})", str(args.steps),
                result.after.perplexity, result.after.kld,
                f"2:4 {'yes' if ok else 'NO'} ({checked} layers), {time.perf_counter() - start:.0f} s")
        total = time.perf_counter() - t0

    print(f"\nteacher {args.teacher.name}; training text {args.train_text.name}, {args.steps} steps × {args.batch_size} × "
          f"{args.seq_len} tokens, lr {args.lr}; eval: first {args.eval_tokens} tokens of {args.eval_text.name} (ctx 512)\n")
    print("| model | steps | perplexity | mean KLD vs teacher | note |")
    print("| --- | --- | --- | --- | --- |")
    for label, steps, ppl, kld, note in rows:
        print(f"| {label} | {steps} | {ppl:.3f} | {kld:.4f} | {note} |")
    print(f"\ntotal {total:.0f} s")


if __name__ == "__main__":
    main()
