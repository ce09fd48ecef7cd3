"""Quality of quantization methods on the reference model: perplexity and mean KLD against the original.

    python bench/quality.py [--methods rtn,gptq,gptq:act_order=false] [--settings 8:128,4:-1,4:128,3:128,2:64]
                            [--text ../shared/corpus/shakespeare/test.txt] [--calib FILE --samples 64 --seq-len 512]
                            [--model DIR|FILE.gguf] [--ctx 512] [--max-tokens N] [--rotations none,random-hadamard]
                            [--format fake]

One row per method and setting (bits:group_size, symmetric), with the figures `compress eval ppl` reports.
Methods that need calibration data get ``--calib``; extra method settings follow a colon (``name:key=value``).
``--rotations`` repeats every row after each fused rotation (`compress quantize --rotate KIND`; ``none``: without;
``KIND+r4``: with the online R4 too, `--rotate KIND --rotate-online r4` (``+inputs``: every linear layer's input
online, `--rotate-online inputs`); ``+no-r1`` / ``+no-r2``: without the fused
residual-stream / value rotation, the rotate stage's ``residual: false`` / ``heads: false``, e.g.
``random-hadamard+no-r1+no-r2+r4`` for R4 alone; ``+b16``: every rotation in blocks of 16, ``block: 16``; ``+s1``: the
random signs' seed 1). ``learned`` trains R1 and R2 on the calibration windows against the loss of the model on the
row's input grid (the method's ``activations``; the weights in float, as SpinQuant does before GPTQ), or without one
on the row's weight grid; ``+tN``: N Cayley SGD steps, ``+wN``: N windows per step).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

from compress.run.recipe import parse_recipe
from compress.engine.methods.rotate import training_grid
from compress.engine.registry import method_class
from compress.run.runner import run_recipe

REPO = Path(__file__).resolve().parents[1]


def parse_method(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        options[key] = yaml.safe_load(value)
    return name, options


def quality_parser(doc: str) -> argparse.ArgumentParser:
    """Model, evaluation text and calibration options shared by the quality benchmarks."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "eval/assets/reference-llama")
    ap.add_argument("--text", type=Path, default=REPO / "eval/assets/shakespeare-test-slice.txt")
    ap.add_argument("--calib", type=Path, default=REPO / "eval/assets/shakespeare-calib-slice.txt")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    return ap


def rotate_stage(rotation: str) -> dict:
    """The rotate stage of ``KIND[+r4|+inputs][+no-r1][+no-r2][+bN][+sN][+tN][+wN]`` (``t``, ``w``: learned's steps
    and windows per step)."""
    kind, *parts = rotation.split("+")
    number = lambda letter: next((int(p[1:]) for p in parts if p[:1] == letter and p[1:].isdigit()), None)  # noqa: E731
    learned = {key: number(letter) for key, letter in (("steps", "t"), ("windows", "w")) if number(letter) is not None}
    return {"method": "rotate", "kind": kind, "online": [p for p in parts if p in ("r4", "inputs")],
            "residual": "no-r1" not in parts, "heads": "no-r2" not in parts, "block": number("b"), "seed": number("s") or 0,
            **learned}


def quality_row(args: argparse.Namespace, spec: str, bits: int, group: int, rotation: str, out: Path):
    """Compress ``args.model`` with method ``spec`` (``name:key=value;...``) at ``bits``:``group`` after
    ``rotation`` (``none`` or `rotate_stage`'s ``KIND[+r4|+inputs][+no-r1][+no-r2][+bN][+sN][+tN][+wN]``) into ``out`` and evaluate it on
    ``args.text`` (its ``EvalResult``). ``args``: model, text, calib, samples, seq_len, ctx, max_tokens, format."""
    name, options = parse_method(spec)
    method = method_class(name)(method_class(name).Config(**options))
    rotate = [] if rotation == "none" else [rotate_stage(rotation)]
    if rotate and rotate[0]["kind"] == "learned":
        rotate[0].update(training_grid(bits, group, options))
    data = {
        "model": args.model,
        "stages": rotate + [{"method": name, "bits": bits, "group_size": group, **options}],
        "output": {"path": out, "overwrite": True, "format": args.format},
        "evaluation": {"text": args.text, "ctx": args.ctx, "max_tokens": args.max_tokens},
    }
    if method.needs or method.block_inputs:
        data["calibration"] = {"path": args.calib, "samples": args.samples, "seq_len": args.seq_len}
    return run_recipe(parse_recipe(data)).evaluation


def main() -> None:
    ap = quality_parser(__doc__)
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--settings", default="8:128,4:-1,4:128,3:128,2:64")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the text")
    ap.add_argument("--rotations", default="none",
                    help="comma-separated: none, hadamard, random-hadamard, learned, or "
                         "KIND[+r4|+inputs][+no-r1][+no-r2][+bN][+sN][+tN][+wN]")
    ap.add_argument("--format", default="compressed-tensors", help="output format; fake for simulated-only schemes (W4A4 int)")
    args = ap.parse_args()
    settings = [tuple(int(x) for x in s.split(":")) for s in args.settings.split(",")]
    print(f"model {args.model}, text {args.text}, ctx {args.ctx}; calibration {args.calib.name} "
          f"{args.samples}x{args.seq_len}")
    width = max(22, *(len(spec) + 2 for spec in args.methods.split(",")))
    print(f"{'method':<{width}}{'rotation':<20}{'setting':<14}{'ppl':>9}{'ref ppl':>9}{'ppl +%':>9}{'mean KLD':>11}{'KLD p99':>9}{'time':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.methods.split(","):
            for (bits, group), rotation in ((s, r) for s in settings for r in args.rotations.split(",")):
                start = time.perf_counter()
                ev = quality_row(args, spec, bits, group, rotation, Path(tmp) / "out")
                setting = f"w{bits} " + ("per-chan" if group == -1 else f"g{group}")
                print(f"{spec:<{width}}{rotation:<20}{setting:<14}{ev.perplexity:>9.3f}{ev.ref_perplexity:>9.3f}"
                      f"{100 * (ev.perplexity / ev.ref_perplexity - 1):>8.2f}%{ev.kld:>11.5f}{ev.kld_p99:>9.4f}"
                      f"{time.perf_counter() - start:>7.0f}s", flush=True)


if __name__ == "__main__":
    main()
