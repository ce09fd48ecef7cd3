"""Per-layer allocation on the reference model: does the proxy rank layers as the real KLD does, and does
an allocated plan beat the uniform settings of the same or larger size?

    python bench/allocation_quality.py [--candidates w2g64,w2g128,w3g64,w3g128,w4g64,w4g128,w5g128,w8]
        [--targets 3.0,3.5,4.0] [--uniform w2g64,w3g128,w3g64,w4g128,w4g64] [--truth w2g64,w3g128,w4g128]
        [--samples 64 --seq-len 256] [--max-tokens 8192] [--work DIR]

1. `compress measure` (GPTQ) into ``WORK/sensitivity.json`` (reused when present).
2. The truth: for every layer and each ``--truth`` candidate, that layer alone quantized by GPTQ (on the
   original model's Hessian), the rest untouched, and the mean KLD on the first ``--max-tokens`` tokens of
   the text (ctx 512). Spearman's rank correlation of each proxy with it, over all (layer, candidate)
   pairs and per candidate (across layers).
3. GPTQ with the allocated plan at each ``--targets`` bits per weight (the planned layers, scales included),
   and GPTQ with each ``--uniform`` setting, all evaluated on the whole text: measured KLD vs predicted.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from compress.checkpoints.calibration import CalibrationSpec, load_calibration
from compress.checkpoints.loading import load_model, load_tokenizer, read_eval_text
from compress.engine.sensitivity import SolverSettings, quantize_with
from compress.engine.statistics import InputStatistics, Stat
from compress.eval.perplexity import evaluate
from compress.formats.candidates import parse_candidate
from compress.run.measure import run_measure
from compress.run.plan import load_sensitivity, uniform_plan
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import quality_parser  # noqa: E402  (bench/ is the script's folder)


def hessians(model, windows: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    modules = dict(model.named_modules())
    stats = {n: InputStatistics(modules[n].in_features, frozenset({Stat.HESSIAN})) for n in names}
    hooks = [modules[n].register_forward_pre_hook(lambda _m, args, n=n: stats[n].update(args[0])) for n in names]
    with torch.inference_mode():
        for batch in windows.split(8):
            model(batch)
    for h in hooks:
        h.remove()
    return {n: s.result()[Stat.HESSIAN] for n, s in stats.items()}


def truth(args, sens, windows) -> dict[tuple[str, str], float]:
    """Mean KLD with exactly one layer quantized, per (layer, candidate)."""
    device = torch.device("cpu")
    reference = load_model(args.model, device)
    model = load_model(args.model, device)
    ids = load_tokenizer(args.model)(read_eval_text(args.text), add_special_tokens=False)["input_ids"][: args.max_tokens]
    tokens = torch.tensor(ids)
    names = list(sens.layers)
    hs = hessians(model, windows, names)
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        weight = modules[name].weight.detach().clone()
        for c in args.truth.split(","):
            q = quantize_with(parse_candidate(c), weight, hs[name], SolverSettings())
            with torch.no_grad():
                modules[name].weight.copy_(q)
            out[name, c] = evaluate(model, tokens, ctx=512, reference=reference).kld
            with torch.no_grad():
                modules[name].weight.copy_(weight)
    return out


def gptq_run(args, out: Path, stage: dict) -> dict:
    recipe = parse_recipe({
        "model": args.model, "stages": [{"method": "gptq", **stage}],
        "calibration": {"path": args.calib, "samples": args.samples, "seq_len": args.seq_len},
        "output": {"path": out, "overwrite": True}, "evaluation": {"text": args.text, "ctx": 512},
    })
    result = run_recipe(recipe)
    return {"kld": result.evaluation.kld, "ppl": result.evaluation.perplexity, "plans": result.plans}


def main() -> None:
    ap = quality_parser(__doc__)
    ap.set_defaults(seq_len=256)
    ap.add_argument("--candidates", default="w2g64,w2g128,w3g64,w3g128,w4g64,w4g128,w5g128,w8")
    ap.add_argument("--truth", default="w2g64,w3g128,w4g128")
    ap.add_argument("--targets", default="3.0,3.5,4.0")
    ap.add_argument("--uniform", default="w2g64,w3g128,w3g64,w4g128,w4g64")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--work", type=Path, default=Path("out/allocation-bench"))
    ap.add_argument("--skip-truth", action="store_true")
    args = ap.parse_args()
    spec = CalibrationSpec(path=args.calib, samples=args.samples, seq_len=args.seq_len)
    start = time.perf_counter()
    measured = run_measure(args.model, spec, args.candidates, args.work / "sensitivity.json")
    sens = measured.sensitivity
    print(f"measured {measured.measured or '-'} (reused {measured.reused or '-'}) in {time.perf_counter() - start:.0f} s; "
          f"gain {sens.gain():.4g}, per candidate {({c: round(g, 3) for c, g in sens.gains().items()})}")

    if not args.skip_truth:
        windows = load_calibration(args.calib, load_tokenizer(args.model), args.samples, args.seq_len, 0)
        true = truth(args, sens, windows)
        costs = sens.costs()
        proxies = {
            "predicted KLD (gain x residual error)": lambda n, c: costs[n][c],
            "GPTQ proxy tr(dW H dW^T)": lambda n, c: sens.layers[n]["candidates"][c]["layer_error"],
            "relative proxy / tr(W H W^T)": lambda n, c: sens.layers[n]["candidates"][c]["rel_error"],
        }
        print(f"\nSpearman rank correlation with the true single-layer KLD ({len(true)} pairs, first {args.max_tokens} tokens)")
        print(f"{'proxy':<40}{'all pairs':>10}" + "".join(f"{c:>10}" for c in args.truth.split(",")))
        for label, proxy in proxies.items():
            keys = list(true)
            row = f"{label:<40}{spearmanr([proxy(*k) for k in keys], [true[k] for k in keys])[0]:>10.3f}"
            for c in args.truth.split(","):
                ks = [k for k in keys if k[1] == c]
                row += f"{spearmanr([proxy(*k) for k in ks], [true[k] for k in ks])[0]:>10.3f}"
            print(row)
        ratio = [costs[n][c] / true[n, c] for n, c in true if true[n, c] > 0]
        print(f"predicted / true single-layer KLD: median {np.median(ratio):.2f}, 10-90% {np.percentile(ratio, 10):.2f}-{np.percentile(ratio, 90):.2f}")

    print(f"\nGPTQ on {args.samples}x{args.seq_len} calibration tokens, KLD on all of {args.text.name} (ctx 512)")
    print(f"{'setting':<18}{'bits/weight':>12}{'predicted KLD':>15}{'measured KLD':>14}{'ppl':>9}")
    for c in args.uniform.split(","):
        plan = uniform_plan(sens, c)
        r = gptq_run(args, args.work / f"uniform-{c}", {"bits": parse_candidate(c).scheme.bits, "group_size": parse_candidate(c).scheme.group_size})
        print(f"{'uniform ' + c:<18}{plan.bits_per_weight:>12.3f}{plan.predicted_kld:>15.5f}{r['kld']:>14.5f}{r['ppl']:>9.3f}")
    for t in args.targets.split(","):
        r = gptq_run(args, args.work / f"plan-{t}", {"plan": {"path": args.work / "sensitivity.json", "target_bpw": float(t)}})
        plan = r["plans"][0]
        print(f"{'allocated ' + t:<18}{plan['bits_per_weight']:>12.3f}{plan['predicted_kld']:>15.5f}{r['kld']:>14.5f}{r['ppl']:>9.3f}")


if __name__ == "__main__":
    main()
