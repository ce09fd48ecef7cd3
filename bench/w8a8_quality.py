"""W8A8 quality on the reference model and on its outlier-injected copy: perplexity and mean KLD.

    python bench/w8a8_quality.py [--text ../shared/corpus/shakespeare/test.txt] [--samples 64]

Rows: plain W8A8 (int8 per-channel weights, int8 activations) without smoothing, with SmoothQuant's
smoothing (alpha 0.5), and smoothing with GPTQ-solved int8 weights; per-token dynamic and per-tensor
static activation scales. The outlier copy scales the reference model's four most relied-on hidden
channels x50 at every norm, compensated in the weights (eval/outliers.py): same function, LLM-like
activation outliers.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from compress.eval.outliers import save_outlier_model
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from quality import quality_parser  # bench/ is the script's folder

ROWS = {
    "W8A8, no smoothing": [{"method": "smoothquant", "smooth": False}],
    "SmoothQuant W8A8": [{"method": "smoothquant"}],
    "SmoothQuant + GPTQ W8A8": [{"method": "smoothquant", "quantize_weights": False},
                                {"method": "gptq", "bits": 8, "group_size": -1}],
}


def main() -> None:
    args = quality_parser(__doc__).parse_args()
    print(f"text {args.text}, ctx 512; calibration {args.calib.name} {args.samples}x{args.seq_len}")
    print(f"{'model':<10}{'method':<26}{'activations':<13}{'ppl':>9}{'ref ppl':>9}{'mean KLD':>11}{'KLD p99':>9}{'time':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        models = {"reference": args.model, "outliers": save_outlier_model(args.model, Path(tmp) / "outliers")}
        for label, model in models.items():
            for row, stages in ROWS.items():
                for activations in ("token", "tensor"):
                    stages = [dict(s, activations=activations) if s["method"] == "smoothquant" else s for s in stages]
                    data = {
                        "model": model,
                        "stages": stages,
                        "calibration": {"path": args.calib, "samples": args.samples, "seq_len": args.seq_len},
                        "output": {"path": Path(tmp) / "out", "overwrite": True, "format": "fake"},
                        "evaluation": {"text": args.text, "ctx": 512},
                    }
                    start = time.perf_counter()
                    ev = run_recipe(parse_recipe(data)).evaluation
                    print(f"{label:<10}{row:<26}{activations:<13}{ev.perplexity:>9.3f}{ev.ref_perplexity:>9.3f}"
                          f"{ev.kld:>11.5f}{ev.kld_p99:>9.4f}{time.perf_counter() - start:>6.0f}s", flush=True)


if __name__ == "__main__":
    main()
