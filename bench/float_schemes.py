"""Named schemes (FP8, NVFP4, MXFP4 and their integer neighbours) x RTN / GPTQ on the reference model, through
the recipe runner: perplexity, mean KLD against the original, bits per weight of the block linear layers as
stored, and the size of the weight files.

    python bench/float_schemes.py [--schemes fp8-dynamic,fp8-block,nvfp4,nvfp4a16,mxfp4,mxfp4a16,w4a16,w4g16,w8a8-int8]
                                  [--methods rtn,gptq,awq] [--model DIR] [--text FILE] [--max-tokens 8192]
                                  [--calib FILE --samples 64 --seq-len 256] [--keep DIR]

``w4g16`` is int4 with one scale per 16 weights (symmetric), NVFP4's group size on the integer grid.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import quality_parser  # noqa: E402

from compress.errors import CompressError  # noqa: E402
from compress.eval.report import checkpoint_figures  # noqa: E402
from compress.run.recipe import parse_recipe  # noqa: E402
from compress.run.runner import run_recipe  # noqa: E402

EXTRA = {"w4g16": {"bits": 4, "group_size": 16, "symmetric": True}}  # not a named scheme: settings


def stage(method: str, scheme: str) -> dict:
    return {"method": method, **EXTRA[scheme]} if scheme in EXTRA else {"method": method, "scheme": scheme}


def main() -> None:
    ap = quality_parser(__doc__)
    ap.set_defaults(seq_len=256)
    ap.add_argument("--schemes", default="fp8-dynamic,fp8-block,nvfp4,nvfp4a16,mxfp4,mxfp4a16,w4a16,w4g16,w8a8-int8")
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--keep", type=Path, help="keep the outputs in this folder")
    args = ap.parse_args()
    print(f"model {args.model}, text {args.text.name} (first {args.max_tokens} tokens, ctx {args.ctx}); "
          f"calibration {args.calib.name} {args.samples}x{args.seq_len}")
    print(f"| scheme | method | ppl | mean KLD | bits/weight | size (MB) | time (s) |\n| --- | --- | --- | --- | --- | --- | --- |")
    ev = None
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for scheme in args.schemes.split(","):
            for method in args.methods.split(","):
                data = {
                    "model": args.model,
                    "stages": [stage(method, scheme)],
                    "calibration": {"path": args.calib, "samples": args.samples, "seq_len": args.seq_len},
                    "output": {"path": root / f"{scheme}-{method}", "overwrite": True},
                    "evaluation": {"text": args.text, "ctx": args.ctx, "max_tokens": args.max_tokens},
                }
                start = time.perf_counter()
                try:
                    result = run_recipe(parse_recipe(data))
                except CompressError as exc:  # e.g. a group size the model's widths do not divide: a row, not a stop
                    print(f"| {scheme} | {method} | {exc} | | | | |", flush=True)
                    continue
                ev, fig = result.evaluation, checkpoint_figures(result.output)
                print(f"| {scheme} | {method} | {ev.perplexity:.3f} | {ev.kld:.5f} | {fig['bits_per_weight']:.3f} | "
                      f"{fig['size_bytes'] / 1e6:.2f} | {time.perf_counter() - start:.0f} |", flush=True)
        if ev is not None:
            print(f"baseline ppl {ev.ref_perplexity:.3f}")


if __name__ == "__main__":
    main()
