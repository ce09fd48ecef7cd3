"""Wall time of a calibrated GGUF export, ours beside llama.cpp's own tools, from the same checkpoint and tokens.

    python bench/gguf_pace.py [--model DIR] [--type q4_k_m] [--methods gptq imatrix] [--calib FILE --samples 32
        --seq-len 512] [--threads 2] [--repeat 3] [--converter ours|llama.cpp] [--text FILE --max-tokens N]
        [--workdir DIR] [--json PATH]

Every step is a whole process, timed from its start to its exit (what a user waits for), its peak RSS from its own
resource usage (`os.wait4`); within each repeat the tools alternate (llama.cpp's steps, then each of our methods),
and the tables give medians, with each run's ratios:

- ``convert``: the checkpoint as an F16 GGUF, which llama.cpp's tools need and ours does not: ``--converter ours``
  (the default) runs ``compress export --type f16``, ``llama.cpp`` the vendored ``convert_hf_to_gguf.py`` (on a copy
  of config.json that names the architecture, which a checkpoint converted from a GGUF file lacks; for llama's
  tokenizer it needs the ``sentencepiece`` package, which this project's environment does not install).
- ``llama-imatrix``: on that F16 file over the first ``samples`` windows of ``seq-len`` tokens of the calibration
  text, ``-t threads`` (one window per batch, no perplexity; `llama_cpp_tools.llama_imatrix`);
- ``llama-quantize --imatrix``: the F16 file in ``--type`` with that matrix (llama.cpp's own mix for q4_k_m), ``threads``
  threads;
- ours: ``compress export MODEL --type T --method M --calib FILE --samples N --seq-len L`` for each ``--methods``
  (``samples`` random windows of the same text, seed 0: the same number of tokens, not the same windows), with
  ``OMP_NUM_THREADS=threads``.

The protocol of the ratio: llama.cpp's two tools (imatrix + quantize), without the conversion, which a user who has
an F16 GGUF already skips; the ratio with the conversion counted is printed beside it (a user starting from a HF
checkpoint runs all three). Each method's last output and llama.cpp's are scored by llama.cpp through our evaluator
(`evaluate_outputs`, as bench/gguf_quality.py): mean KL(HF model || GGUF) and perplexity over the held-out text in
windows of 512 tokens (``--max-tokens``: the first N tokens only). The machine's load average is printed at the start and
the end: on a shared machine only ratios measured back to back mean anything, and the CPU seconds (user + system of
each process) beside the walls say how much of a wall was waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gguf_imatrix_check import ASSETS, calibration_windows
from llama_cpp_tools import binary_path, cache_dir, tool

from compress.formats.gguf.plan import FILE_TYPE, PRESETS, Target

COMPRESS = Path(sys.executable).with_name("compress")  # the command users run, in this interpreter's environment


def timed(command: list[str], log: Path, env: dict | None = None) -> tuple[float, float, float]:
    """Run ``command`` as a fresh process (its output to ``log``): its wall seconds, CPU seconds (user + system, its
    waited-for children's included) and peak RSS in GB."""
    if hasattr(os, "sync"):
        os.sync()  # the previous step's written pages flushed: each step starts from the same disk state
    start = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)  # its own resource usage (RUSAGE_CHILDREN's peak is of every child)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"{' '.join(map(str, command))} failed (exit {code}):\n{tail}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1e6  # Linux: KiB


def named_architecture(model: Path, scratch: Path) -> Path:
    """``model`` itself when its config.json names its architecture, else a folder of links to its files with a
    config.json that does (``LlamaForCausalLM`` for ``model_type`` llama ...): convert_hf_to_gguf.py dispatches on it."""
    config = json.loads((model / "config.json").read_text())
    if config.get("architectures"):
        return model
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
    if config.get("model_type") not in names:
        raise SystemExit(f"{model}/config.json names no architecture: add one, or use --converter ours")
    copy = scratch / f"{model.name}-named"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "config.json":
            (copy / f.name).symlink_to(f.resolve())
    (copy / "config.json").write_text(json.dumps({**config, "architectures": [names[config["model_type"]]]}, indent=2))
    return copy


def convert_command(args, model: Path, out: Path) -> list[str]:
    if args.converter == "ours":
        return [str(COMPRESS), "export", str(model), "-o", str(out), "--type", "f16", "--overwrite"]
    src = cache_dir() / "src"
    return [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out), "--outtype", "f16"]


def llama_steps(args, f16: Path, work: Path) -> list[tuple[str, list[str]]]:
    """llama-imatrix then llama-quantize --imatrix, the arguments `llama_cpp_tools` gives them."""
    imatrix, out = work / "imatrix-llama.gguf", work / f"{args.type}-llama.cpp.gguf"
    target = Target(args.type)
    return [
        ("llama-imatrix", [str(tool("llama-imatrix")), "-m", str(f16), "-f", str(args.calib), "-o", str(imatrix),
                           "-c", str(args.seq_len), "-b", str(args.seq_len), "-ub", str(args.seq_len),
                           "--chunks", str(args.samples), "--no-ppl", "-t", str(args.threads)]),
        ("llama-quantize", [str(tool("llama-quantize")), *([] if target in PRESETS else ["--pure"]), "--imatrix", str(imatrix),
                            str(f16), str(out), str(FILE_TYPE[target]), str(args.threads)]),
    ]


def ours_command(args, method: str, out: Path) -> list[str]:
    return [str(COMPRESS), "export", str(args.model), "-o", str(out), "--type", args.type, "--method", method,
            "--calib", str(args.calib), "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--overwrite"]


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def score(files: dict[str, Path], args) -> dict[str, dict]:
    from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs

    report = evaluate_outputs(list(files.values()), args.model, Protocol(args.text, ctx=512, max_tokens=args.max_tokens),
                              GGUFBackend.LLAMA_CPP)
    return {name: {"kld": row.kld, "perplexity": row.perplexity, "size_bytes": row.size_bytes}
            for name, row in zip(files, report.rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/tmp/smollm2"))
    ap.add_argument("--type", default="q4_k_m", choices=[t.value for t in Target])
    ap.add_argument("--methods", nargs="+", default=["gptq", "imatrix"], choices=["gptq", "imatrix", "awq", "awq-gptq"])
    ap.add_argument("--calib", type=Path, default=ASSETS / "shakespeare-calib-slice.txt")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's -t and our OMP_NUM_THREADS")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--converter", choices=["llama.cpp", "ours"], default="ours",
                    help="what writes the F16 GGUF for llama.cpp's tools (timed as its own step)")
    ap.add_argument("--text", type=Path, default=ASSETS / "shakespeare-test-slice.txt", help="held-out text for the KLD")
    ap.add_argument("--max-tokens", type=int, help="score only the first N tokens of --text")
    ap.add_argument("--no-score", action="store_true", help="wall times only")
    ap.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    available = calibration_windows(args.model, args.calib, args.seq_len)
    if args.samples > available:
        raise SystemExit(f"{args.calib} has {available} windows of {args.seq_len} tokens: use --samples {available} or fewer")
    for name in ("llama-imatrix", "llama-quantize"):
        if not binary_path(name).exists():
            print(f"building {name} (first use: bench/llama_cpp_tools.py)", flush=True)
        tool(name)
    print(f"start: {load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        source = named_architecture(args.model, work) if args.converter == "llama.cpp" else args.model
        f16 = work / "model-f16.gguf"
        steps = ["convert", "llama-imatrix", "llama-quantize", *args.methods]
        walls: dict[str, list[float]] = {s: [] for s in steps}
        cpu: dict[str, list[float]] = {s: [] for s in steps}
        rss: dict[str, float] = dict.fromkeys(steps, 0.0)
        for run in range(args.repeat):
            f16.unlink(missing_ok=True)
            plan = [("convert", convert_command(args, source, f16)), *llama_steps(args, f16, work)]
            plan += [(m, ours_command(args, m, work / f"{args.type}-{m}.gguf")) for m in args.methods]
            for name, command in plan:
                seconds, used, peak = timed(command, work / f"{name}.log", env)
                walls[name].append(seconds)
                cpu[name].append(used)
                rss[name] = max(rss[name], peak)
            theirs = walls["llama-imatrix"][-1] + walls["llama-quantize"][-1]
            print(f"run {run + 1}: convert {walls['convert'][-1]:.1f} s, llama-imatrix {walls['llama-imatrix'][-1]:.1f} s, "
                  f"llama-quantize {walls['llama-quantize'][-1]:.1f} s; "
                  + ", ".join(f"ours {m} {walls[m][-1]:.1f} s ({walls[m][-1] / theirs:.2f}x)" for m in args.methods)
                  + f"; {load()}", flush=True)
        llama = [a + b for a, b in zip(walls["llama-imatrix"], walls["llama-quantize"])]
        with_convert = [a + c for a, c in zip(llama, walls["convert"])]
        scores = {}
        if not args.no_score:
            files = {"llama.cpp": work / f"{args.type}-llama.cpp.gguf", **{m: work / f"{args.type}-{m}.gguf" for m in args.methods}}
            scores = score(files, args)
        print(f"\n{args.model.name}, {args.type}, calibration {args.samples} x {args.seq_len} tokens of {args.calib.name}, "
              f"{args.threads} threads, medians of {args.repeat}; F16 by {args.converter}; end: {load()}")
        llama_cpu = [a + b for a, b in zip(cpu["llama-imatrix"], cpu["llama-quantize"])]
        print("\n| step | wall s | CPU s | peak RSS GB |\n|---|---:|---:|---:|")
        for name in steps:
            print(f"| {name} | {statistics.median(walls[name]):.2f} | {statistics.median(cpu[name]):.2f} | {rss[name]:.2f} |")
        print(f"| llama.cpp: imatrix + quantize | {statistics.median(llama):.2f} | {statistics.median(llama_cpu):.2f} | |")
        print(f"| llama.cpp: convert + imatrix + quantize | {statistics.median(with_convert):.2f} | | |")
        base = scores.get("llama.cpp", {}).get("kld")
        print("\n| ours | wall s | x llama.cpp (imatrix + quantize), by run | x with convert | x CPU s | KLD | x llama.cpp KLD | ppl |"
              "\n|---|---:|---|---:|---:|---:|---:|---:|")
        if base is not None:
            print(f"| llama.cpp + imatrix | {statistics.median(llama):.2f} | 1 | | 1 | {base:.5f} | 1 | {scores['llama.cpp']['perplexity']:.3f} |")
        figures = {}
        for m in args.methods:
            ratios = [a / b for a, b in zip(walls[m], llama)]
            with_conv = statistics.median(a / b for a, b in zip(walls[m], with_convert))
            cpu_ratio = statistics.median(a / b for a, b in zip(cpu[m], llama_cpu))
            s = scores.get(m, {})
            kld = f"{s['kld']:.5f} | {s['kld'] / base:.2f}" if s and base else " | "
            ppl = f"{s['perplexity']:.3f}" if s else ""
            print(f"| {m} | {statistics.median(walls[m]):.2f} | {statistics.median(ratios):.2f} "
                  f"({', '.join(f'{r:.2f}' for r in ratios)}) | {with_conv:.2f} | {cpu_ratio:.2f} | {kld} | {ppl} |")
            figures[m] = {"ratio": statistics.median(ratios), "ratios": ratios, "ratio_with_convert": with_conv, "cpu_ratio": cpu_ratio}
        if args.json:
            args.json.write_text(json.dumps({"walls": walls, "cpu_seconds": cpu, "rss_gb": rss, "scores": scores, "ratios": figures,
                                             "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))


if __name__ == "__main__":
    main()
