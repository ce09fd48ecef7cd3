"""RTN quality on the reference model: perplexity and mean KLD against the unquantized model.

    python bench/rtn_quality.py [--model eval/assets/reference-llama] [--text ../shared/corpus/shakespeare/test.txt]

Prints one row per setting (bits, group size; symmetric) with the figures `compress eval ppl` reports.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from compress.recipe import parse_recipe
from compress.runner import run_recipe

REPO = Path(__file__).resolve().parents[1]
SETTINGS = [(8, 128), (4, -1), (4, 128), (3, 128), (2, 64)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "eval/assets/reference-llama")
    ap.add_argument("--text", type=Path, default=REPO / "eval/assets/shakespeare-test-slice.txt")
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    print(f"model {args.model}, text {args.text}, ctx {args.ctx}")
    print(f"{'setting':<16}{'ppl':>10}{'ref ppl':>10}{'ppl +%':>9}{'mean KLD':>11}{'KLD p99':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for bits, group in SETTINGS:
            recipe = parse_recipe({
                "model": args.model,
                "stages": [{"method": "rtn", "bits": bits, "group_size": group}],
                "output": {"path": Path(tmp) / f"w{bits}g{group}"},
                "evaluation": {"text": args.text, "ctx": args.ctx},
            })
            ev = run_recipe(recipe).evaluation
            setting = f"w{bits} " + ("per-channel" if group == -1 else f"g{group}")
            print(f"{setting:<16}{ev.perplexity:>10.3f}{ev.ref_perplexity:>10.3f}"
                  f"{100 * (ev.perplexity / ev.ref_perplexity - 1):>8.2f}%{ev.kld:>11.5f}{ev.kld_p99:>10.4f}", flush=True)


if __name__ == "__main__":
    main()
