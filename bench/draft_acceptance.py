"""Draft models for speculative decoding: which training gives the highest acceptance rate α?

One student shape (the target's every other layer, weights copied), trained for the same steps, batch and
schedule four ways: (a) `--objective draft` on sequences the target generates (total variation, and forward
KL), (b) plain KD on the corpus (soft targets only), (c) cross-entropy only on the corpus. For each:
`compress eval speculative` figures (α greedy and sampled, on held-out text and on the target's own
continuations; tokens per target call for K = 1..8; the measured assisted-generation speed-up).

    python bench/draft_acceptance.py [--target DIR] [--steps 100] [--temperature 0.7] [--keep DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus" / "shakespeare"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=REPO / "eval" / "assets" / "reference-llama")
    parser.add_argument("--train-text", type=Path, default=CORPUS / "train.txt")
    parser.add_argument("--eval-text", type=Path, default=REPO / "eval" / "assets" / "shakespeare-test-slice.txt")
    parser.add_argument("--student", default="every:2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=0.7, help="serving temperature: draft data sampled at it, α measured at it and at 0")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", default="draft-tv,draft-kl,kd,ce")
    parser.add_argument("--draft-prompts", type=int, default=256, help="prompts the target continues for the draft objective")
    parser.add_argument("--keep", type=Path, help="write the drafts here (one folder per kind) instead of a temporary directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    from compress.distill.config import DistillSpec, StudentSpec
    from compress.eval.speculative import evaluate_speculative
    from compress.run.distill import run_distill
    from compress.run.recipe import OutputSpec

    kind, _, value = args.student.partition(":")
    student = StudentSpec(**{kind: int(value) if kind == "every" else [int(v) for v in value.split(",")]})
    common = dict(data=args.train_text, student=student, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                  warmup_steps=max(1, args.steps // 10), draft_prompts=args.draft_prompts)
    kinds = {
        "draft-tv": dict(objective="draft", draft_loss="tv", draft_temperature=args.temperature),
        "draft-kl": dict(objective="draft", draft_loss="kl", draft_temperature=args.temperature),
        "kd": dict(alpha=1.0, tau=1.0),
        "ce": dict(alpha=0.0),
    }
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        cache = Path(tmp) / "draft-data"  # generated once, shared by both draft losses
        for name in args.kinds.split(","):
            out = Path(tmp) / name
            spec = DistillSpec(**common, **kinds[name], draft_cache=cache)
            run_distill(args.target, spec, OutputSpec(path=out, overwrite=True))
            for temperature in (0.0, args.temperature):
                r = evaluate_speculative(out, args.target, args.eval_text, k=args.k, temperature=temperature)
                rows.append((name, temperature, r))
                t = r.timing
                print(f"  row: {name} T={temperature} α text {r.alpha_text:.4f} α gen {r.alpha_generated:.4f} "
                      f"calls {t.tokens_per_call:.2f} speed-up {t.speedup:.2f}", file=sys.stderr, flush=True)
    print(f"target {args.target.name}, student {args.student}; {args.steps} steps × {args.batch_size} × {args.seq_len} tokens, lr {args.lr}; "
          f"α on the first 4096 tokens of {args.eval_text.name} and on 8 × 64 tokens the target generates; K = {args.k} for the timing")
    print("| draft | T | α text | α continuations | E[tokens/call] K=1,2,4,8 (continuations) | measured tokens/call | tokens/s plain → assisted | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, temperature, r in rows:
        t, e = r.timing, r.expected["generated"]
        print(f"| {name} | {temperature:g} | {r.alpha_text:.4f} | {r.alpha_generated:.4f} | {e[1]:.2f} / {e[2]:.2f} / {e[4]:.2f} / {e[8]:.2f} | "
              f"{t.tokens_per_call:.2f} | {t.plain_tokens_per_second:.1f} → {t.assisted_tokens_per_second:.1f} | {t.speedup:.2f}× |")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
