"""W4A4 with rotations beside llm-compressor 0.14's ``QuIPModifier`` + ``GPTQModifier``, on the same windows.

    python bench/quip_anchor.py [--model DIR] [--calib FILE --samples 32 --seq-len 512] [--text FILE --ctx 512
                                --max-tokens 4096] [--bits 4 --group-size 64] [--methods gptq:activations=int4-token]
                                [--rotations none,random-hadamard,random-hadamard+r4]
                                [--anchors gptq-w4a4,quip-w4a4,quip-w4a4:block=64] [--no-check] [--threads 1]

The scheme: int4 g64 symmetric weights by GPTQ (static act order), int4 symmetric per-token dynamic activations.
Our rows are bench/quality.py's (`quality_row`, ``--format fake``: our evaluator simulates the activations), one per
``--rotations`` entry. The anchor rows run llm-compressor's ``oneshot`` in its own venv
(bench/anchors/llmcompressor_oneshot.py; ``~/.cache/llm-compress/llmcompressor-0.14``, built as bench/pipeline.py
builds it) on the very token ids our calibration draws (``--samples`` windows of ``--seq-len`` from ``--calib``,
seed 0, written to JSON). ``gptq-w4a4``: ``GPTQModifier`` alone; ``quip-w4a4``: ``QuIPModifier`` (input rotations
``v``, ``random-hadamard`` of each layer's whole input width, its defaults) then the same ``GPTQModifier``;
``quip-w4a4:block=B``: block-diagonal transforms of B × B.

Our evaluator reads neither W4A4's ``int-quantized`` group-wise weights nor QuIP's per-layer transforms, so the
anchor is scored inside its venv, on the model as llm-compressor leaves it in memory (fake-quantized weights, its
activation quantization, its online transforms), against a freshly loaded float model, by our evaluator's protocol
on the same held-out token ids (written to JSON). ``--check`` (on by default) shows the two scorers equal in the same
run: llm-compressor's weight-only GPTQ (w4 g64), scored in its venv and, written in compressed-tensors, by our
evaluator. Prints one table: mean KLD, perplexity, and the KLD as a ratio to our unrotated row.
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

from pipeline import ANCHOR_VENV, anchor_python  # bench/ is on sys.path: run as a script
from quality import quality_parser, quality_row

REPO = Path(__file__).resolve().parents[1]
ONESHOT = REPO / "bench" / "anchors" / "llmcompressor_oneshot.py"


def run_anchor(python: Path, args, method: str, out: Path, windows: Path, tokens: Path) -> dict:
    """llm-compressor's ``method`` on ``windows``, scored in its venv on ``tokens``: its ``score.json``."""
    command = [str(python), str(ONESHOT), str(args.model), str(out), str(windows), method, str(args.bits),
               str(args.group_size), "1", "cpu", str(tokens), str(args.ctx)]
    log = out.with_suffix(".log")
    with log.open("w") as sink:
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, stdout=sink,
                              stderr=subprocess.STDOUT, cwd="/")
    if done.returncode:
        raise SystemExit(f"llm-compressor {method} failed (exit {done.returncode}):\n"
                         + "\n".join(log.read_text().splitlines()[-20:]))
    return json.loads((out / "score.json").read_text())


def main() -> None:
    ap = quality_parser(__doc__)
    ap.set_defaults(samples=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--methods", default="gptq:activations=int4-token", help="our methods (bench/quality.py's syntax)")
    ap.add_argument("--rotations", default="none,random-hadamard,random-hadamard+r4")
    ap.add_argument("--anchors", default="gptq-w4a4,quip-w4a4,quip-w4a4:block=64",
                    help="llm-compressor methods (bench/anchors/llmcompressor_oneshot.py)")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="score llm-compressor's w4 g64 weight-only GPTQ with both scorers")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    ap.add_argument("--venv", type=Path, default=ANCHOR_VENV)
    args = ap.parse_args()
    args.format = "fake"

    from compress.checkpoints.calibration import load_calibration
    from compress.checkpoints.loading import load_tokenizer, read_eval_text
    from compress.eval.checkpoint import evaluate_checkpoint, token_ids

    python = anchor_python(args.venv)
    print(f"model {args.model}, text {args.text.name} (first {args.max_tokens} tokens, ctx {args.ctx}); calibration "
          f"{args.calib.name} {args.samples}x{args.seq_len}, seed 0; w{args.bits} g{args.group_size}, a4 per token; "
          f"{args.threads} thread(s)", flush=True)
    rows: list[tuple[str, dict, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        tokenizer = load_tokenizer(args.model)
        windows, tokens = scratch / "windows.json", scratch / "eval-tokens.json"
        windows.write_text(json.dumps(load_calibration(args.calib, tokenizer, args.samples, args.seq_len).tolist()))
        tokens.write_text(json.dumps(token_ids(tokenizer, read_eval_text(args.text), args.max_tokens).tolist()))
        for spec in args.methods.split(","):
            for rotation in args.rotations.split(","):
                start = time.perf_counter()
                ev = quality_row(args, spec, args.bits, args.group_size, rotation, scratch / "ours")
                figures = {"kld": ev.kld, "perplexity": ev.perplexity, "ref_perplexity": ev.ref_perplexity}
                rows.append((f"ours {spec}, rotation {rotation}", figures, time.perf_counter() - start))
                print(f"  {rows[-1][0]}: KLD {ev.kld:.5f}, ppl {ev.perplexity:.2f} ({rows[-1][2]:.0f} s)", flush=True)
        for method in args.anchors.split(","):
            start = time.perf_counter()
            figures = run_anchor(python, args, method, scratch / f"anchor-{len(rows)}", windows, tokens)
            rows.append((f"llm-compressor {method}", figures, time.perf_counter() - start))
            print(f"  {rows[-1][0]}: KLD {figures['kld']:.5f}, ppl {figures['perplexity']:.2f} ({rows[-1][2]:.0f} s)",
                  flush=True)
        check = None
        if args.check:
            out = scratch / "anchor-w4a16"
            theirs = run_anchor(python, args, "gptq", out, windows, tokens)
            ev = evaluate_checkpoint(out, args.text, args.ctx, None, 8, args.model, "cpu", args.max_tokens)
            check = (theirs["kld"], ev.kld, theirs["perplexity"], ev.perplexity)
    base = rows[0][1]["kld"]
    print(f"\nfloat model ppl {rows[0][1]['ref_perplexity']:.2f}")
    width = max(len(name) for name, _, _ in rows)
    print(f"| {'row':<{width}} | {'mean KLD':>9} | {'ppl':>9} | KLD / first row |\n| {'-' * width} | {'-' * 8}: | "
          f"{'-' * 8}: | {'-' * 14}: |")
    for name, figures, _ in rows:
        print(f"| {name:<{width}} | {figures['kld']:>9.5f} | {figures['perplexity']:>9.2f} | {figures['kld'] / base:>15.3f} |")
    if check is not None:
        kt, ko, pt, po = check
        print(f"\nscorer check, llm-compressor GPTQ w{args.bits} g{args.group_size} weight-only: in its venv KLD {kt:.6f} "
              f"ppl {pt:.4f}; our evaluator KLD {ko:.6f} ppl {po:.4f}; relative difference KLD {abs(kt / ko - 1):.2e}, "
              f"ppl {abs(pt / po - 1):.2e}")


if __name__ == "__main__":
    main()
