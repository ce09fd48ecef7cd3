"""Evaluation throughput with a reference: the former algorithm, the streamed one, and a saved reference.

    python bench/eval_throughput.py [--model DIR|FILE.gguf] [--text FILE] [--ctx 512] [--batch-size 8]
                                    [--max-tokens N] [--top-k 256] [--noise 0.05] [--threads N] [--device cpu|cuda]

The evaluated model is the reference with Gaussian noise (``--noise`` x each tensor's std, seed 0) added
to every weight, so its KLD is not 0. Each variant runs in its own child process (so its peak RSS is its
own) with ``--threads`` torch threads:

- ``ppl only``: `evaluate` without a reference (one model's forward passes: the anchor);
- ``before``: the former `evaluate` loop, kept here as `former_evaluate`: float32 log-softmax of every scored
  position of every window of the batch for both models, then float64 copies for the KL;
- ``after``: `evaluate(..., reference=REF)`: log-softmax and KL per chunk of positions, in float32;
- ``save reference``: `build_reference_cache` (the reference alone, once), written with `save_reference_cache`;
- ``cache``: `evaluate(..., reference_cache=...)` from that file, without the reference (a lower-bound KLD).

Prints tokens/s and its ratio to ``before``, peak RSS and the peak growth during the evaluation itself
(VmHWM reset through /proc/self/clear_refs after loading), and the figures, so equal results can be seen.
``--device cuda`` runs both models on the GPU and adds the peak device memory during the evaluation
(`torch.cuda.max_memory_allocated` after loading, reset, minus what was allocated).
With ``--model FILE.gguf`` a last row runs llama.cpp's ``llama-perplexity`` on the same file and text (``-c CTX``,
``--chunks`` covering the same tokens, ``-t THREADS``; built by ``bench/llama_cpp_tools.py`` on first use): its
tokens/s is every token of every window through the model over the time its log stamps between starting the
windows and its final estimate (it scores the second half of each window), beside ours (every token scored once).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("ppl only", "before", "after", "save reference", "cache")


def former_evaluate(model, tokens, ctx: int, stride: int, batch_size: int, reference) -> dict:
    """The algorithm `evaluate` had before streaming (same protocol, same figures), for the comparison."""
    import numpy as np
    import torch

    from compress.eval.perplexity import _batches, sliding_windows

    def scored_log_probs(m, input_ids, batch):
        logits = m(input_ids=input_ids, use_cache=False).logits
        return [logits[row, w.score_from - w.begin - 1 : w.end - w.begin - 1].float().log_softmax(dim=-1) for row, w in enumerate(batch)]

    def nll(lp, targets):
        return -lp.gather(-1, targets.unsqueeze(-1)).double().sum().item()

    windows = sliding_windows(len(tokens), ctx, stride)
    nll_sum, ref_nll_sum, n, klds = 0.0, 0.0, 0, []
    with torch.inference_mode():
        for batch in _batches(windows, batch_size):
            input_ids = torch.stack([tokens[w.begin : w.end] for w in batch]).to(model.device)
            log_probs, ref_log_probs = scored_log_probs(model, input_ids, batch), scored_log_probs(reference, input_ids, batch)
            for i, w in enumerate(batch):
                targets = input_ids[i, w.score_from - w.begin : w.end - w.begin]
                nll_sum += nll(log_probs[i], targets)
                ref_nll_sum += nll(ref_log_probs[i], targets)
                n += len(targets)
                ref_lp, lp = ref_log_probs[i].double(), log_probs[i].double()
                klds.append((ref_lp.exp() * (ref_lp - lp)).sum(dim=-1))
    per_token = torch.cat(klds).cpu()
    return {"perplexity": math.exp(nll_sum / n), "tokens_scored": n, "kld": per_token.mean().item(),
            "kld_p99": float(np.percentile(per_token.numpy(), 99)), "ref_perplexity": math.exp(ref_nll_sum / n)}


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    except OSError:
        pass


def child(args) -> None:
    import torch

    from compress.checkpoints.loading import load_model, load_tokenizer
    from compress.eval.perplexity import build_reference_cache, evaluate
    from compress.eval.reference_cache import load_reference_cache, save_reference_cache

    torch.set_num_threads(args.threads)
    ids = load_tokenizer(args.model)(args.text.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False)["input_ids"]
    tokens = torch.tensor(ids[: args.max_tokens] if args.max_tokens else ids)
    device = torch.device(args.device)
    reference = load_model(args.model, device)
    model = load_model(args.model, device)
    gen = torch.Generator().manual_seed(0)  # on the CPU: the same noise on either device
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(device) * args.noise * p.std())
    variant, kw = args.child, dict(ctx=args.ctx, stride=args.ctx, batch_size=args.batch_size, device=device)
    cache = load_reference_cache(args.cache) if variant == "cache" else None
    if variant in ("ppl only", "cache"):
        del reference
    if variant == "save reference":
        del model
    _reset_peak()
    loaded = _rss_mib("VmRSS")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
    start = time.perf_counter()
    if variant == "before":
        figures = former_evaluate(model, tokens, args.ctx, args.ctx, args.batch_size, reference)
    elif variant == "save reference":
        built, result = build_reference_cache(reference, tokens, top_k=args.top_k, **kw)
        save_reference_cache(built, args.cache)
        figures = {"perplexity": result.perplexity, "tokens_scored": result.tokens_scored}
    else:
        result = evaluate(model, tokens, reference=reference if variant == "after" else None, reference_cache=cache, **kw)
        figures = {k: getattr(result, k) for k in ("perplexity", "tokens_scored", "kld", "kld_p99", "ref_perplexity")}
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    gpu_mib = (torch.cuda.max_memory_allocated() - held) / 2**20 if cuda else None
    print(json.dumps({**figures, "seconds": seconds, "peak_mib": _rss_mib("VmHWM"), "eval_mib": _rss_mib("VmHWM") - loaded,
                      "gpu_mib": gpu_mib}))


def llama_perplexity(gguf: Path, text: Path, ctx: int, threads: int, max_tokens: int | None) -> dict:
    """llama.cpp's ``llama-perplexity`` on ``gguf``: tokens it ran through the model, seconds (from its log's
    time stamps, loading excluded) and its final perplexity estimate."""
    sys.path.insert(0, str(REPO / "bench"))
    from llama_cpp_tools import tool

    command = [str(tool("llama-perplexity")), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
               "-t", str(threads)] + (["--chunks", str(max(1, max_tokens // ctx))] if max_tokens else [])
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # its log lines start with the time since start, minutes.seconds.milliseconds.microseconds
    stamp = lambda m: int(m.group(1)) * 60 + int(m.group(2)) + int(m.group(3)) / 1e3  # noqa: E731
    start = re.search(r"^(\d+)\.(\d+)\.(\d+)\.\d+ I perplexity: calculating perplexity over (\d+) chunks, n_ctx=(\d+)",
                      done.stdout, re.M)
    end = re.search(r"^(\d+)\.(\d+)\.(\d+)\.\d+ I Final estimate: PPL = ([\d.]+)", done.stdout, re.M)
    if done.returncode != 0 or start is None or end is None:
        raise SystemExit(f"llama-perplexity failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return {"tokens": int(start.group(4)) * int(start.group(5)), "seconds": stamp(end) - stamp(start),
            "perplexity": float(end.group(4))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "eval/assets/reference-llama")
    ap.add_argument("--text", type=Path, default=REPO / "eval/assets/shakespeare-test-slice.txt")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--top-k", type=int, default=256)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (cache needs save reference)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    from compress.checkpoints.gguf_source import checkpoint_source

    with checkpoint_source(args.model) as model_dir, tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "reference.safetensors"
        common = ["--model", str(model_dir), "--text", str(args.text), "--ctx", str(args.ctx), "--batch-size",
                  str(args.batch_size), "--top-k", str(args.top_k), "--noise", str(args.noise), "--threads",
                  str(args.threads), "--device", args.device, "--cache", str(cache)] + (["--max-tokens", str(args.max_tokens)] if args.max_tokens else [])
        rows = {}
        for variant in args.variants.split(","):
            out = subprocess.run([sys.executable, __file__, *common, "--child", variant], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{variant}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        cache_mib = cache.stat().st_size / 2**20 if cache.exists() else float("nan")
    print(f"model {args.model}, text {args.text.name}, ctx {args.ctx}, batch {args.batch_size}, "
          f"{args.threads} thread(s), top-k {args.top_k} (cache file {cache_mib:.1f} MiB), device {args.device}\n")
    print("| variant | tokens/s | × before | peak RSS (MiB) | growth during eval (MiB) | GPU growth (MiB) | ppl | ref ppl "
          "| mean KLD | KLD p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    anchor = rows.get("before")
    for variant, r in rows.items():
        tps = r["tokens_scored"] / r["seconds"]
        ratio = f"{tps / (anchor['tokens_scored'] / anchor['seconds']):.2f}" if anchor else "n/a"
        fmt = lambda key, spec: format(r[key], spec) if r.get(key) is not None else "-"  # noqa: E731
        print(f"| {variant} | {tps:.0f} | {ratio} | {r['peak_mib']:.0f} | {r['eval_mib']:.0f} | {fmt('gpu_mib', '.0f')} "
              f"| {fmt('perplexity', '.4f')} "
              f"| {fmt('ref_perplexity', '.4f')} | {fmt('kld', '.6f')} | {fmt('kld_p99', '.5f')} |")
    if args.model.suffix == ".gguf":
        llama = llama_perplexity(args.model, args.text, args.ctx, args.threads, args.max_tokens)
        ours = rows.get("ppl only")
        ratio = f"{(ours['tokens_scored'] / ours['seconds']) / (llama['tokens'] / llama['seconds']):.2f}" if ours else "n/a"
        print(f"\nllama-perplexity on the same file: {llama['tokens']} tokens in {llama['seconds']:.2f} s = "
              f"{llama['tokens'] / llama['seconds']:.0f} tokens/s (its ppl estimate {llama['perplexity']}); "
              f"ours (ppl only) / llama.cpp = {ratio}")
    if anchor and "after" in rows:
        print(f"\nafter vs before: mean KLD relative difference {rows['after']['kld'] / anchor['kld'] - 1:.2e}, "
              f"perplexity {rows['after']['perplexity'] / anchor['perplexity'] - 1:.2e}")


if __name__ == "__main__":
    main()
