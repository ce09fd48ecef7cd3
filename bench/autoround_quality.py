"""Our AutoRound beside Intel's auto-round 0.16.1 on one model and the same calibration windows.

    python bench/autoround_quality.py [--model /tmp/smollm2] [--blocks N] [--bits 4 3 2] [--group-size 64]
                                      [--iters 200] [--batch-size 8] [--calib FILE --samples 32 --seq-len 512]
                                      [--text FILE --max-tokens 4096] [--threads 2] [--amp | --no-amp]
                                      [--set KEY=VALUE ...] [--seeds 0 1 2 3]
                                      [--gguf q4_k_m q3_k_m [--ours autoround gptq ...]]

For each bit width, symmetric integer weights in groups of ``--group-size``: our ``compress quantize --method
autoround -O iters=N -O batch_size=B`` and auto-round (``AutoRound(..., iters=N, batch_size=B)`` then
``quantize_and_save(format="llm_compressor")``, bench/anchors/autoround_run.py, in its own virtual environment built
on first use by bench/anchors/autoround_venv.py). Each tool runs as a whole process from its start to its exit, one
after the other, with ``OMP_NUM_THREADS=--threads``; wall time and that process's peak RSS (`os.wait4`). Both
calibrate on the very same windows: ours reads ``--calib`` (`load_calibration`), and those windows' token ids are
handed to auto-round as its dataset, one ``[1, seq_len]`` tensor each (auto-round masks each window's last position
out of its attention and its loss; see the anchor's docstring). Both outputs are compressed-tensors checkpoints,
scored by our evaluator on ``--text`` (``compress eval ppl --reference MODEL --json``: mean KLD against the model and
perplexity). This process imports neither torch nor ours (the truncated copy and the windows come from a child,
``--prepare``): a child's peak RSS counts its parent's at the fork, which Linux keeps across exec. ``--amp``
(auto-round's default on a CPU): auto-round tunes in bfloat16; ``--no-amp``: in float32, as ours does on a float32
model. auto-round compiles its block forward with ``torch.compile`` from 10 iters on (its default), and inductor's
cache (``/tmp/torchinductor_$USER``) makes its later runs start faster than its first: clear it, or run once before
timing. ``--blocks N`` runs both on a copy of the model truncated to its first N blocks. Prints one row per tool and
bit width, and ours / auto-round ratios. ``--seeds S ...``: each tool once per seed (ours ``-O seed=S``, auto-round's
``seed=S``: the order in which each draws its mini-batches), a row per tool, seed and bit width, then each tool's
median KLD and the ratio of the medians: with few steps the draw of mini-batches moves a KLD by several per cent.

``--gguf TYPE ...`` (llama.cpp mixes such as q4_k_m, q3_k_m) writes GGUF files instead of the integer rows, three
per type: auto-round's own GGUF export (scheme ``GGUF:Q4_K_M``, ``quantize_and_save(format="gguf:q4_k_m")``, same
windows, iters, batch size and ``--amp``), our ``compress export --type TYPE --method autoround -O iters=N -O
batch_size=B`` and our ``--method gptq`` of the same type, both with ``--calib --samples --seq-len``. ``--ours``
names our exports, each ``METHOD[:KEY=VALUE,...]`` (its ``-O`` settings; autoround's after ``--iters``,
``--batch-size`` and ``--set``), e.g. ``--ours autoround autoround:init=gptq gptq``. llama.cpp scores
each: ``llama-perplexity --kl-divergence`` (bench/llama_cpp_tools.py) against the logits of the model's F16 GGUF
(``compress export --type f16``) saved by ``--kl-divergence-base`` over the first ``--max-tokens`` of ``--text`` in
windows of 512 tokens (llama.cpp scores the second half of each window). Prints type, tool, wall, peak RSS, file
size, llama.cpp's mean KLD, and each one's ratios to auto-round's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench" / "anchors"), str(REPO / "bench")]
from autoround_venv import DEFAULT_VENV, build_venv  # noqa: E402
from llama_cpp_tools import tool  # noqa: E402  (the standard library only)

LLAMA_CTX = 512  # llama-perplexity's window


def timed(command: list[str], log: Path, threads: int) -> tuple[float, float]:
    """Wall seconds and peak RSS in GB of ``command`` as one whole process (its output to ``log``); fails loudly."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if hasattr(os, "sync"):
        os.sync()  # each tool starts without the other's pages to write back
    start = time.perf_counter()
    with log.open("w") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=log.parent)
        _, status, usage = os.wait4(process.pid, 0)  # its own resource usage
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"{command[0]} failed (exit {code}):\n{tail}")
    return seconds, usage.ru_maxrss / 1e6  # Linux: KiB


def calibration(args) -> list[str]:
    return ["--calib", str(args.calib), "--samples", str(args.samples), "--seq-len", str(args.seq_len)]


def autoround_settings(args) -> list[str]:
    """``-O`` settings of our autoround: auto-round's iters and batch size, then ``--set``."""
    return [arg for item in (f"iters={args.iters}", f"batch_size={args.batch_size}", *args.set) for arg in ("-O", item)]


def ours(args, model: Path, bits: int, out: Path, seed: int | None = None) -> tuple[float, float]:
    compress = Path(sys.executable).with_name("compress")
    command = [str(compress), "quantize", str(model), "-o", str(out), "--bits", str(bits), "--group-size",
               str(args.group_size), "--method", "autoround", *calibration(args), "--compute-dtype", args.compute_dtype,
               *autoround_settings(args), *(["-O", f"seed={seed}"] if seed is not None else [])]
    return timed(command, out.with_name(out.name + ".log"), args.threads)


def ours_gguf(args, model: Path, kind: str, spec: str, out: Path) -> tuple[float, float]:
    """``compress export --type kind --method METHOD`` of ``spec`` (``METHOD[:KEY=VALUE,...]``; autoround with
    auto-round's iters and batch size, then the spec's settings)."""
    compress = Path(sys.executable).with_name("compress")
    method, _, settings = spec.partition(":")
    extra = [arg for item in settings.split(",") if item for arg in ("-O", item)]
    command = [str(compress), "export", str(model), "-o", str(out), "--type", kind, "--method", method,
               *calibration(args), *(autoround_settings(args) if method == "autoround" else []), *extra]
    return timed(command, out.with_name(out.name + ".log"), args.threads)


def anchor(args, model: Path, bits: int | str, windows: Path, out: Path, seed: int | None = None) -> tuple[float, float, Path]:
    """auto-round on ``windows``; ``bits`` an int, or a GGUF preset ``gguf:q4_k_m``; ``seed``: its own default where
    None. Its output folder (integer) or file (GGUF)."""
    python = args.venv / "bin" / "python"
    command = [str(python), str(REPO / "bench/anchors/autoround_run.py"), str(model), str(out), str(windows),
               str(bits), str(args.group_size), str(args.iters), str(args.batch_size), str(int(args.amp)),
               *([str(seed)] if seed is not None else [])]
    seconds, rss = timed(command, out.with_name(out.name + ".log"), args.threads)
    if str(bits).startswith("gguf:"):
        return seconds, rss, next(out.rglob("*.gguf"))  # auto-round writes OUT/<model>-gguf/<model>-<size>-<TYPE>.gguf
    written = next(p.parent for p in sorted(out.rglob("config.json")))  # auto-round writes OUT/<model>-w<bits>g<group>/
    return seconds, rss, written


def prepare(spec: dict) -> None:
    """The ``--prepare`` child: the model (truncated to ``blocks`` where given) and the calibration windows' token
    ids, written to ``spec["windows"]``; prints the model's path."""
    import compress  # noqa: F401  (before anything that imports `kernels`: the repository's folder shadows HF's)
    from compress.checkpoints.calibration import load_calibration
    from compress.checkpoints.loading import load_tokenizer

    model = Path(spec["model"])
    if spec["blocks"]:
        sys.path.append(str(REPO / "tests"))
        from conftest import truncate_checkpoint

        model = truncate_checkpoint(model, Path(spec["scratch"]) / f"{model.name}-{spec['blocks']}-blocks", spec["blocks"])
    windows = load_calibration(Path(spec["calib"]), load_tokenizer(model), spec["samples"], spec["seq_len"])
    Path(spec["windows"]).write_text(json.dumps(windows.tolist()))
    print(model)


def score(args, path: Path, model: Path) -> dict:
    """Our evaluator's figures of ``path`` against ``model``, in a process of its own."""
    compress = Path(sys.executable).with_name("compress")
    command = [str(compress), "eval", "ppl", str(path), "--text", str(args.text), "--reference", str(model),
               "--max-tokens", str(args.max_tokens), "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=path.parent, check=True)
    return json.loads(proc.stdout)


def llama_kld(args, gguf: Path, logits: Path, base: bool = False) -> float | None:
    """llama.cpp's own mean KLD of ``gguf`` against the saved ``logits`` (``base``: save them from ``gguf`` over
    ``--text`` instead, and return None)."""
    chunks = max(1, args.max_tokens // LLAMA_CTX)
    command = [str(tool("llama-perplexity")), "-m", str(gguf), "-c", str(LLAMA_CTX), "-b", str(LLAMA_CTX), "-t",
               str(args.threads), "--kl-divergence-base", str(logits)]
    command += ["-f", str(args.text), "--chunks", str(chunks)] if base else ["--kl-divergence"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    gguf.with_name(gguf.name + ".kld.log").write_text(done.stdout)
    found = re.search(r"^Mean\s+KLD:\s+(-?[\d.]+)", done.stdout, re.M)
    if done.returncode != 0 or not (base or found):
        raise SystemExit(f"llama-perplexity failed (exit {done.returncode}) on {gguf}:\n{done.stdout[-3000:]}")
    return None if base else float(found.group(1))


def gguf_rows(args, model: Path, tokens: Path, scratch: Path) -> None:
    """The ``--gguf`` table: per type auto-round's GGUF export and ours (``--ours``), scored by llama.cpp."""
    compress = Path(sys.executable).with_name("compress")
    f16, logits = scratch / "model-f16.gguf", scratch / "model-f16.kld"
    subprocess.run([str(compress), "export", str(model), "-o", str(f16), "--type", "f16"], capture_output=True,
                   check=True, cwd=scratch, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    llama_kld(args, f16, logits, base=True)
    print(f"llama.cpp's KLD against the F16 GGUF's logits: {args.max_tokens // LLAMA_CTX} windows of {LLAMA_CTX} "
          f"tokens of {args.text.name}\n", flush=True)
    print("| type | tool | wall s | x auto-round | peak RSS GB | x auto-round | size MB | KLD (llama.cpp) | x auto-round |"
          "\n|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for kind in args.gguf:
        rows = {}
        wall, rss, theirs = anchor(args, model, f"gguf:{kind}", tokens, scratch / f"autoround-{kind}")
        rows["auto-round 0.16.1"] = (wall, rss, theirs)
        for number, spec in enumerate(args.ours):
            out = scratch / f"ours-{kind}-{number}.gguf"
            rows[f"ours {spec}"] = (*ours_gguf(args, model, kind, spec, out), out)
        klds = {name: llama_kld(args, path, logits) for name, (_, _, path) in rows.items()}
        wall_ar, rss_ar, _ = rows["auto-round 0.16.1"]
        kld_ar = klds["auto-round 0.16.1"]
        for name, (wall, rss, path) in rows.items():
            print(f"| {kind} | {name} | {wall:.1f} | {wall / wall_ar:.2f} | {rss:.2f} | {rss / rss_ar:.2f} | "
                  f"{path.stat().st_size / 1e6:.2f} | {klds[name]:.5f} | {klds[name] / kld_ar:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/tmp/smollm2"))
    ap.add_argument("--blocks", type=int, help="run both tools on a copy truncated to the first N blocks")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8, help="calibration windows per step (both tools)")
    ap.add_argument("--calib", type=Path, default=REPO / "eval/assets/shakespeare-calib-slice.txt")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--text", type=Path, default=REPO / "eval/assets/shakespeare-test-slice.txt")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--compute-dtype", default="auto", help="our block forwards' dtype (`compress quantize --compute-dtype`)")
    ap.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                    help="auto-round tunes in bfloat16 (its default on a CPU); --no-amp: in float32")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another setting of our method")
    ap.add_argument("--seeds", type=int, nargs="+", help="each tool once per seed of its mini-batch order; medians")
    ap.add_argument("--gguf", nargs="+", metavar="TYPE", help="GGUF types (q4_k_m q3_k_m ...): auto-round's GGUF export, "
                    "our autoround and gptq exports, scored by llama-perplexity --kl-divergence, instead of --bits")
    ap.add_argument("--ours", nargs="+", default=["autoround", "gptq"], metavar="METHOD[:KEY=VALUE,...]",
                    help="with --gguf: our exports, each a method and its -O settings (autoround:init=gptq)")
    ap.add_argument("--prepare", help=argparse.SUPPRESS)  # `prepare` in its own process
    args = ap.parse_args()
    if args.prepare:
        return prepare(json.loads(args.prepare))

    print(build_venv(args.venv), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        tokens = scratch / "windows.json"
        spec = {"model": str(args.model), "blocks": args.blocks, "scratch": str(scratch), "calib": str(args.calib),
                "samples": args.samples, "seq_len": args.seq_len, "windows": str(tokens)}
        proc = subprocess.run([sys.executable, __file__, "--prepare", json.dumps(spec)], capture_output=True, text=True,
                              cwd=scratch, check=True)
        model = Path(proc.stdout.strip().splitlines()[-1])
        windows = json.loads(tokens.read_text())
        grid = f"GGUF {' '.join(args.gguf)}" if args.gguf else f"int sym g{args.group_size}"
        print(f"model {model.name}, {grid}, {args.iters} iters, batch {args.batch_size}, "
              f"calibration {len(windows)} x {len(windows[0])}, {args.threads} threads, "
              f"auto-round {'bfloat16 (amp)' if args.amp else 'float32'}\n", flush=True)
        if args.gguf:
            return gguf_rows(args, model, tokens, scratch)
        print("| bits | seed | tool | wall s | x auto-round | peak RSS GB | KLD | ppl |\n|---:|---:|---|---:|---:|---:|---:|---:|",
              flush=True)
        ratios = []
        for bits in args.bits:
            klds: dict[str, list[float]] = {"ours": [], "auto-round": []}
            walls: dict[str, list[float]] = {"ours": [], "auto-round": []}
            for seed in args.seeds or [None]:
                mine = scratch / f"ours-w{bits}"
                wall_ours, rss_ours = ours(args, model, bits, mine, seed)
                wall_ar, rss_ar, theirs = anchor(args, model, bits, tokens, scratch / f"autoround-w{bits}", seed)
                scores = {"ours": score(args, mine, model), "auto-round": score(args, theirs, model)}
                for key, name, wall, rss in (("ours", "ours", wall_ours, rss_ours),
                                             ("auto-round", "auto-round 0.16.1", wall_ar, rss_ar)):
                    print(f"| {bits} | {'default' if seed is None else seed} | {name} | {wall:.1f} | {wall / wall_ar:.2f} | "
                          f"{rss:.2f} | {scores[key]['kld']:.5f} | {scores[key]['perplexity']:.3f} |", flush=True)
                    klds[key].append(scores[key]["kld"])
                    walls[key].append(wall)
                shutil.rmtree(mine, ignore_errors=True)
                shutil.rmtree(theirs.parent, ignore_errors=True)
            kld = {key: statistics.median(values) for key, values in klds.items()}
            wall = {key: statistics.median(values) for key, values in walls.items()}
            if args.seeds:
                print(f"| {bits} | median | ours / auto-round | {wall['ours']:.1f} / {wall['auto-round']:.1f} | "
                      f"{wall['ours'] / wall['auto-round']:.2f} | | {kld['ours']:.5f} / {kld['auto-round']:.5f} | |", flush=True)
            ratios.append((bits, wall["ours"] / wall["auto-round"], rss_ours / rss_ar, kld["ours"] / kld["auto-round"]))
        print("\nours / auto-round" + (" (medians over the seeds; RSS of the last)" if args.seeds else "") + ": "
              + "; ".join(f"w{b}: wall {w:.2f}, RSS {r:.2f}, KLD {k:.2f}" for b, w, r, k in ratios))


if __name__ == "__main__":
    main()
