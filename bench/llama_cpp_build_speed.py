"""What the portable llama.cpp build costs: the reference model's perplexity run through the installed
llama-cpp-python (built with the README's portable CMAKE_ARGS) and through another build of it.

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip wheel --no-deps --no-cache-dir llama-cpp-python -w /tmp/native
    pip install --no-deps --target /tmp/native-site /tmp/native/llama_cpp_python-*.whl
    python bench/llama_cpp_build_speed.py --other /tmp/native-site [--types q4_k_m q8_0] [--tokens 8192]

Each build runs in its own child process (`LlamaCppWorker`; the other build first on that child's path), so
a build that cannot run on this CPU prints its signal instead of ending the bench. Both score the same
token ids of the held-out slice in windows of ``--ctx`` from an empty cache (as `compress report`), with
``--threads`` threads; the time is the child's own decode time (the model's load and the transfer of logits
not counted). Prints tokens/s of each, the ratio, the features each build uses and that both perplexities
agree. Run it on a quiet machine: the figures are ratios measured in one run.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def use_site(state: dict, site: str | None) -> str:
    """In the child: put ``site`` first on the path (before llama_cpp is imported); the build's features."""
    if site:
        sys.path.insert(0, site)
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def timed_perplexity(state: dict, path: str, tokens: list[int], ctx: int, threads: int) -> tuple[float, float]:
    """In the child: (perplexity, decode seconds) of ``tokens`` in consecutive windows of ``ctx``."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False, n_threads=threads, seed=0)
    nll, count, seconds = 0.0, 0, 0.0
    for begin in range(0, len(tokens) - 1, ctx):
        window = tokens[begin : begin + ctx]
        llm.reset()
        start = time.perf_counter()
        llm.eval(window)
        seconds += time.perf_counter() - start
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= logp[np.arange(len(window) - 1), window[1:]].sum()
        count += len(window) - 1
    llm.close()
    return math.exp(nll / count), seconds


def run_build(site: str | None, files: dict[str, Path], tokens: list[int], ctx: int, threads: int) -> tuple[str, dict]:
    from compress.eval.llama_cpp_worker import LlamaCppCrash, LlamaCppWorker

    label = site or "installed (portable)"
    results: dict[str, tuple[float, float] | str] = {}
    with LlamaCppWorker(label) as worker:
        try:
            info = worker.call(use_site, site, doing="loading")
        except LlamaCppCrash as crash:
            return str(crash), {}
    for name, path in files.items():
        with LlamaCppWorker(path.name) as worker:  # a fresh child per file: one crash costs one row
            try:
                worker.call(use_site, site, doing="loading")
                results[name] = worker.call(timed_perplexity, str(path), tokens, ctx, threads, doing="evaluating")
            except LlamaCppCrash as crash:
                results[name] = str(crash)
    return info, results


def main() -> None:
    from tokenizers import Tokenizer

    from compress.export.gguf import ExportConfig, export_gguf
    from compress.formats.gguf.plan import Target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="site folder holding another llama_cpp build (e.g. native)")
    ap.add_argument("--model", type=Path, default=REPO / "eval" / "assets" / "reference-llama")
    ap.add_argument("--text", type=Path, default=REPO / "eval" / "assets" / "shakespeare-test-slice.txt")
    ap.add_argument("--types", nargs="+", default=["q4_k_m", "q8_0", "f16"], choices=[t.value for t in Target])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    ids = Tokenizer.from_file(str(args.model / "tokenizer.json")).encode(args.text.read_text(encoding="utf-8")).ids[: args.tokens]
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name in args.types:
            files[name] = Path(tmp) / f"reference-{name}.gguf"
            export_gguf(ExportConfig(args.model, files[name], Target(name)))
        portable_info, portable = run_build(None, files, ids, args.ctx, args.threads)
        other_info, other = run_build(args.other, files, ids, args.ctx, args.threads)
    print(f"model {args.model.name}, {len(ids)} tokens of {args.text.name}, ctx {args.ctx}, {args.threads} threads")
    print(f"portable build: {portable_info}")
    print(f"other build ({args.other}): {other_info}")
    print(f"{'type':8s} {'portable tok/s':>15s} {'other tok/s':>12s} {'portable/other':>15s}  perplexity portable / other")
    for name in args.types:
        a, b = portable.get(name), other.get(name)
        if isinstance(a, tuple) and isinstance(b, tuple):
            ta, tb = len(ids) / a[1], len(ids) / b[1]
            print(f"{name:8s} {ta:15.0f} {tb:12.0f} {ta / tb:15.3f}  {a[0]:.4f} / {b[0]:.4f}")
        else:
            print(f"{name:8s} portable: {a if isinstance(a, str) else f'{len(ids) / a[1]:.0f} tok/s'}; other: "
                  f"{b if isinstance(b, str) else f'{len(ids) / b[1]:.0f} tok/s'}")


if __name__ == "__main__":
    main()
