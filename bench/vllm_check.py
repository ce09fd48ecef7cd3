"""vLLM as the consumer of every scheme we write: load, perplexity beside ours, generation; and serving speed.

    python bench/vllm_check.py [--model SMOLLM2] [--blocks 6] [--max-tokens 2048] [--throughput] [--schemes a,b]

Each scheme is written by ``compress quantize`` (or ``compress prune``) from a copy of the model cut to its first
``--blocks`` decoder blocks (0: the whole model), then vLLM (its CPU build, in the venv of
``bench/anchors/vllm_venv.py``, in a child process: `compress.eval.vllm_backend`) loads it once and
- scores the same windows our evaluator scores (``--max-tokens`` held-out tokens at ctx 512; dtype float32,
  what ours computes in, or where vLLM's CPU kernel refuses float32 (its int4 GEMM), both in bfloat16), both
  perplexities printed with their ratio;
- decodes 16 tokens greedily from a fixed prompt, compared with our model's greedy tokens (transformers'
  ``generate`` on our loaded checkpoint).
A cell vLLM refuses holds vLLM's exception line. A row whose vLLM run used an fp8 KV cache is followed by ours with the
cache rounded toward zero, as vLLM's CPU cache stores it (``bench/vllm_kv_rounding.py``). ``--noise CHECKPOINT...``: only our perplexity of those
checkpoints with the input embeddings perturbed by 1e-6 (relative), three seeds: the spread of a figure under
a float32-rounding-sized change of the computation, which is the scale on which two correct W8A8 implementations
differ. ``--throughput``: vLLM's offline generation speed, 64 prompts
of 32 tokens x 128 new tokens (``ignore_eos``) in one ``LLM.generate`` call, float, FP8 dynamic and W8A8, in
bfloat16 (vLLM's CPU default), printed as tokens/s and as a ratio to the float model's speed in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from compress.errors import CompressError
from compress.eval.vllm_backend import VllmRefused, VllmSettings, resolve_python, run_worker, score_tasks
from compress.quantizers.kv_cache import FP8Rounding

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "eval/assets/shakespeare-test-slice.txt"
CALIB = REPO / "eval/assets/shakespeare-calib-slice.txt"
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is"
CAL = ["--calib", str(CALIB), "--samples", "16", "--seq-len", "256"]
# name -> the compress command's arguments after MODEL -o OUT (SmolLM2's width 576 has no group or block of 128:
# the g128 and FP8-block rows quantize the layers whose inputs are 1536 wide, down_proj)
SCHEMES: dict[str, list[str]] = {
    "float": [],
    "w4a16 sym g64": ["quantize", "--bits", "4", "--group-size", "64"],
    "w4a16 sym g64 full range (signed scales)": ["quantize", "--bits", "4", "--group-size", "64", "-O", "full_range=true"],
    "w4a16 asym g64": ["quantize", "--bits", "4", "--group-size", "64", "--asym"],
    "w4a16 sym g128 (down_proj)": ["quantize", "--bits", "4", "--group-size", "128", "--include", r"mlp\.down_proj"],
    "w4a16 asym g128 (down_proj)": ["quantize", "--bits", "4", "--group-size", "128", "--asym", "--include", r"mlp\.down_proj"],
    "w4a16 sym channel": ["quantize", "--bits", "4", "--group-size", "-1"],
    "w8a16 channel": ["quantize", "--bits", "8", "--group-size", "-1"],
    "w8a8 int8 static (smoothquant)": ["quantize", "--method", "smoothquant", "-O", "activations=tensor", *CAL],
    "w8a8 int8 dynamic (smoothquant)": ["quantize", "--method", "smoothquant", *CAL],
    "w8a8 int8 dynamic (rtn)": ["quantize", "--scheme", "w8a8-int8"],
    "fp8 dynamic": ["quantize", "--scheme", "fp8-dynamic"],
    "fp8 block (down_proj)": ["quantize", "--scheme", "fp8-block", "--include", r"mlp\.down_proj"],
    "nvfp4": ["quantize", "--scheme", "nvfp4", *CAL],
    "nvfp4a16": ["quantize", "--scheme", "nvfp4a16"],
    "mxfp4": ["quantize", "--scheme", "mxfp4"],
    "mxfp4a16": ["quantize", "--scheme", "mxfp4a16"],
    "2:4 sparse (magnitude)": ["prune", "--pattern", "2:4", "--method", "magnitude"],
    "fp8 dynamic + fp8 kv-cache scales": ["quantize", "--scheme", "fp8-dynamic", "--kv-cache", "fp8", *CAL],
    "w4a16 g64 rotated (--rotate hadamard)": ["quantize", "--bits", "4", "--group-size", "64", "--rotate", "hadamard"],
}
THROUGHPUT = ("float", "fp8 dynamic", "w8a8 int8 dynamic (rtn)")


def compress_cli() -> list[str]:
    exe = Path(sys.executable).with_name("compress")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "compress.cli"]


def write(name: str, model: Path, out: Path) -> Path:
    args = SCHEMES[name]
    if not args:
        return model
    command, rest = args[0], args[1:]
    done = subprocess.run([*compress_cli(), command, str(model), "-o", str(out), "--overwrite", *rest],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise CompressError(f"compress {command} failed: {lines[-1] if lines else done.returncode}")
    return out


def ours(path: Path, tokens: torch.Tensor, prompt: list[int], ctx: int, new: int, dtype: torch.dtype = torch.float32,
         rounding: FP8Rounding = FP8Rounding.nearest) -> tuple[float, list[int]]:
    from compress.checkpoints.loading import load_model
    from compress.eval.kv_cache import kv_cache_context, resolve_kv_cache
    from compress.eval.perplexity import evaluate

    model = load_model(path, torch.device("cpu"), dtype)
    setting = resolve_kv_cache(path, model, None)
    if setting is not None:
        setting = dataclasses.replace(setting, rounding=rounding)
    with kv_cache_context(setting, model):
        ppl = evaluate(model, tokens, ctx=ctx).perplexity
    if new == 0:
        return ppl, []
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return ppl, out[0, len(prompt):].tolist()


def noise_floor(path: Path, tokens: torch.Tensor, ctx: int, seeds: int, relative: float = 1e-6) -> list[float]:
    """Our perplexity of ``path`` with its input embeddings multiplied by ``1 + relative * N(0, 1)`` (a fresh draw
    per seed): how far a float32 rounding-sized change of the computation moves the figure. A float model barely
    moves; int8 activations round differently, and the next layers carry the difference on."""
    from compress.checkpoints.loading import load_model
    from compress.eval.perplexity import evaluate

    model = load_model(path, torch.device("cpu"))
    out = []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        hook = model.get_input_embeddings().register_forward_hook(
            lambda _m, _a, y: y * (1 + relative * torch.randn(y.shape, generator=g, dtype=y.dtype)))
        try:
            out.append(evaluate(model, tokens, ctx=ctx).perplexity)
        finally:
            hook.remove()
    return out


def vllm_cells(path: Path, tokens: torch.Tensor, prompt: list[int], ctx: int, new: int, settings: VllmSettings, dtype: str) -> dict:
    from compress.eval.vllm_backend import kv_cache_dtype_for, result_from_log_probs

    score, windows = score_tasks(tokens, ctx, None)
    run = VllmSettings(settings.python, dtype, kv_cache_dtype_for(path, None), settings.timeout)
    answer = run_worker(settings.python, run.request(path, ctx + 1, [score, {"kind": "generate", "prompts": [prompt], "max_tokens": new}]), str(path))
    ppl = result_from_log_probs(answer["results"][0]["log_probs"], windows, 0.0).perplexity
    return {"ppl": ppl, "tokens": answer["results"][1]["token_ids"][0], "load_s": answer["load_seconds"], "kv": run.kv_cache_dtype}


def throughput(path: Path, settings: VllmSettings, vocab: int) -> float:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 100, (64, 32), generator=g).tolist()
    task = {"kind": "generate", "prompts": prompts, "max_tokens": 128, "ignore_eos": True}
    run = VllmSettings(settings.python, "bfloat16", "auto", settings.timeout, {"max_num_seqs": 64, "enforce_eager": False})
    answer = run_worker(settings.python, run.request(path, 256, [task]), str(path))
    result = answer["results"][0]
    return sum(len(t) for t in result["token_ids"]) / result["seconds"]


def truncated(model: Path, blocks: int, scratch: Path) -> Path:
    if blocks <= 0:
        return model
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import truncate_checkpoint  # the tests' block cutter

    return truncate_checkpoint(model, scratch / f"{model.name}-{blocks}-blocks", blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/tmp/smollm2"))
    ap.add_argument("--blocks", type=int, default=6, help="Decoder blocks kept (0: all).")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="Comma-separated names of SCHEMES.")
    ap.add_argument("--throughput", action="store_true", help="Also measure vLLM's generation speed (float, FP8, W8A8).")
    ap.add_argument("--vllm-python", type=Path, default=None)
    ap.add_argument("--noise", type=Path, nargs="+", default=None, metavar="CHECKPOINT",
                    help="Only print our perplexity of these checkpoints with their embeddings perturbed by 1e-6 (relative), 3 seeds.")
    args = ap.parse_args()
    if args.noise:
        from compress.eval.vllm_backend import checkpoint_tokens

        for path in args.noise:
            tokens = checkpoint_tokens(path, args.text, args.max_tokens)
            ppls = noise_floor(path, tokens, args.ctx, 3)
            print(f"{path.name}: ppl with embeddings x (1 + 1e-6 N(0,1)), seeds 0-2: {', '.join(f'{p:.4f}' for p in ppls)} "
                  f"(spread {100 * (max(ppls) / min(ppls) - 1):.2f} %)", flush=True)
        return
    from compress.checkpoints.loading import load_tokenizer
    from compress.eval.vllm_backend import checkpoint_tokens

    settings = VllmSettings(resolve_python(args.vllm_python))
    names = [n.strip() for n in args.schemes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        raise SystemExit(f"unknown schemes {unknown}: choose from {list(SCHEMES)}")
    scratch = Path(tempfile.mkdtemp(prefix="vllm-check-"))
    try:
        model = truncated(args.model, args.blocks, scratch)
        tokens = checkpoint_tokens(model, args.text, args.max_tokens)
        tokenizer = load_tokenizer(model)
        prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        blocks = "all" if args.blocks <= 0 else args.blocks
        print(f"{args.model.name}, {blocks} blocks; {len(tokens)} tokens of {args.text.name} at ctx {args.ctx}; vLLM float32; "
              f"generation: 16 greedy tokens after {len(prompt)} prompt tokens", flush=True)
        print(f"| scheme | load | ppl ours | ppl vLLM | vLLM / ours | generation (vLLM greedy = ours greedy) |")
        print("| --- | --- | ---: | ---: | ---: | --- |", flush=True)
        written = {}
        for name in names:
            start = time.perf_counter()
            try:
                path = write(name, model, scratch / name.replace(" ", "_").replace("/", "-").replace(":", "-"))
            except CompressError as exc:
                print(f"| {name} | not written: {exc} | | | | |", flush=True)
                continue
            written[name] = path
            dtype = "float32"
            try:
                try:
                    v = vllm_cells(path, tokens, prompt, args.ctx, 16, settings, dtype)
                except VllmRefused as refusal:
                    if "for 'Float'" not in refusal.reason:
                        raise
                    dtype = "bfloat16"  # vLLM's CPU kernel has no float32 path: both evaluators in bfloat16
                    v = vllm_cells(path, tokens, prompt, args.ctx, 16, settings, dtype)
            except VllmRefused as refusal:
                ppl, _ = ours(path, tokens, prompt, args.ctx, 0)
                print(f"| {name} | refused ({dtype}): {refusal.reason} | {ppl:.4f} | – | – | – |", flush=True)
                continue
            ppl, greedy = ours(path, tokens, prompt, args.ctx, 16, getattr(torch, dtype))
            same = next((i for i, (a, b) in enumerate(zip(v["tokens"], greedy)) if a != b), len(greedy))
            text = tokenizer.decode(v["tokens"]).replace("\n", " ").replace("|", "/")[:40]
            kv = ("" if v["kv"] == "auto" else f", kv {v['kv']}") + ("" if dtype == "float32" else ", bfloat16: float32 refused")
            print(f"| {name} | ok ({v['load_s']:.0f} s{kv}) | {ppl:.4f} | {v['ppl']:.4f} | {v['ppl'] / ppl:.4f} | "
                  f"{same}/16 same: \"{text}\" |  <!-- {time.perf_counter() - start:.0f} s -->", flush=True)
            if v["kv"].startswith("fp8"):  # vLLM's CPU cache rounds toward zero (bench/vllm_kv_rounding.py): ours the same
                tz, _ = ours(path, tokens, prompt, args.ctx, 0, getattr(torch, dtype), FP8Rounding.toward_zero)
                print(f"| {name}, ours rounding the cache toward zero | | {tz:.4f} | {v['ppl']:.4f} | {v['ppl'] / tz:.4f} | |", flush=True)
        if args.throughput:
            print("\nvLLM offline generation, 64 prompts x 32 tokens, 128 new tokens each, bfloat16, one LLM.generate call")
            print("| scheme | tokens/s | ratio to float |\n| --- | ---: | ---: |")
            base = None
            for name in THROUGHPUT:
                path = written.get(name) or write(name, model, scratch / f"tp-{len(name)}")
                try:
                    speed = throughput(path, settings, len(tokenizer))
                except VllmRefused as refusal:
                    print(f"| {name} | refused: {refusal.reason} | – |", flush=True)
                    continue
                base = base or speed
                print(f"| {name} | {speed:.1f} | {speed / base:.2f} |", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
