"""Structured pruning + distillation repair (Minitron) against a same-size student trained from copied layers.

Rows (perplexity and mean KLD vs the teacher on held-out text, every training run on the same windows,
steps and schedule):

1. `structured` to about half the parameters (MLP and hidden widths, `target_params`), as pruned, after
   N steps of distillation (soft targets only), and after N steps of cross-entropy only;
2. `structured` to the size of the every-other-layer student (same parameter count), the same three;
3. the every-other-layer student (teacher layers 0, 2, ... copied, DistilBERT-style), as initialised, after
   N steps of cross-entropy only and after N steps of distillation;
4. `structured` depth only (`layers` = half, chosen by block influence): the every-other-layer student's
   exact shape with importance-chosen blocks, as pruned and distilled.

    python bench/structured_quality.py [--steps 100] [--rows 1,2,3,4]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus" / "shakespeare"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", type=Path, default=REPO / "eval" / "assets" / "reference-llama")
    parser.add_argument("--train-text", type=Path, default=CORPUS / "train.txt")
    parser.add_argument("--calib", type=Path, default=REPO / "eval" / "assets" / "shakespeare-calib-slice.txt")
    parser.add_argument("--eval-text", type=Path, default=REPO / "eval" / "assets" / "shakespeare-test-slice.txt")
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=64, help="calibration windows of 256 tokens for the importance scores")
    parser.add_argument("--rows", default="1,2,3,4")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)  # 1: the 2 cores are shared; oversubscribed threads spin
    from compress.distill.config import DistillSpec, StudentSpec
    from compress.run.distill import run_distill
    from compress.run.recipe import EvaluationSpec, OutputSpec, parse_recipe
    from compress.run.runner import run_recipe

    rows_wanted = {int(r) for r in args.rows.split(",")}
    evaluation = EvaluationSpec(text=args.eval_text, ctx=512, max_tokens=args.eval_tokens)
    common = dict(data=args.train_text, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                  warmup_steps=max(1, args.steps // 10), tau=2.0)
    rows: list[tuple] = []

    def add(label: str, params: int, ev) -> None:
        rows.append((label, params, ev.perplexity, ev.kld))
        print(f"  row: {rows[-1]}", file=sys.stderr, flush=True)

    def count(path: Path) -> int:
        from transformers import AutoModelForCausalLM

        return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())

    def prune(out: Path, stage: dict) -> Path:
        recipe = parse_recipe({"model": str(args.teacher), "stages": [{"method": "structured", **stage}],
                               "calibration": {"path": str(args.calib), "samples": args.samples, "seq_len": 256},
                               "output": {"path": str(out), "overwrite": True}})
        result = run_recipe(recipe)
        print("  " + "; ".join(result.notes), file=sys.stderr, flush=True)
        return out

    def train(student: dict, out: Path, alpha: float, label: str, before: str | None = None) -> None:
        """Train; add the student's row before training (labelled ``before``, if given) and after."""
        spec = DistillSpec(student=StudentSpec(**student), alpha=alpha, **common)
        result = run_distill(args.teacher, spec, OutputSpec(path=out, overwrite=True), evaluation)
        if before is not None:
            add(before, count(out), result.before)
        add(label, count(out), result.after)

    t0 = time.perf_counter()
    teacher_params = count(args.teacher)
    depth = json.loads((args.teacher / "config.json").read_text())["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        every = {"every": 2}
        sizes = {1: teacher_params // 2}
        if rows_wanted & {2, 3}:
            from compress.distill.student import build_student
            from compress.checkpoints.loading import load_model

            teacher = load_model(args.teacher, torch.device("cpu"))
            sizes[2] = sum(p.numel() for p in build_student(teacher, args.teacher, StudentSpec(**every))[0].parameters())
        for row, what in ((1, "half the parameters"), (2, "the every-other-layer student's size")):
            if row not in rows_wanted:
                continue
            pruned = prune(root / f"s{row}", {"target_params": sizes[row]})
            train({"checkpoint": pruned}, root / f"s{row}-kd", 1.0, f"  + distilled {args.steps} steps (alpha 1)",
                  before=f"structured to {what}, pruned")
            train({"checkpoint": pruned}, root / f"s{row}-ce", 0.0, f"  + cross-entropy only {args.steps} steps")
        if 3 in rows_wanted:
            train(every, root / "e-ce", 0.0, f"  + cross-entropy only {args.steps} steps", before="every other layer, copied")
            train(every, root / "e-kd", 1.0, f"  + distilled {args.steps} steps (alpha 1)")
        if 4 in rows_wanted:
            pruned = prune(root / "d", {"layers": depth // 2})
            train({"checkpoint": pruned}, root / "d-kd", 1.0, f"  + distilled {args.steps} steps (alpha 1)",
                  before=f"structured depth only ({depth // 2} blocks by influence), pruned")
            train({"checkpoint": pruned}, root / "d-ce", 0.0, f"  + cross-entropy only {args.steps} steps")

    print(f"teacher {args.teacher.name}: {teacher_params:,} parameters; eval: first {args.eval_tokens} tokens of "
          f"{args.eval_text.name}, ctx 512; {args.steps} steps × {args.batch_size} × {args.seq_len} tokens, lr {args.lr}")
    print(f"| model | parameters | ppl | mean KLD |\n| --- | --- | --- | --- |")
    for label, params, ppl, kld in rows:
        print(f"| {label} | {params / 1e6:.2f} M | {ppl:.3f} | {kld:.4f} |")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
