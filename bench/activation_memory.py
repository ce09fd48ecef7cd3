"""Peak memory of calibrating with many long windows, with and without ``--activation-memory``.

    python bench/activation_memory.py [--width 2048] [--blocks 2] [--samples 64 --seq-len 512] [--budget 64MB]
                                      [--method gptq|sparsegpt|wanda] [--threads 2] [--budget-only]

Builds a random Llama (vocabulary 2000, MLP 2.75x the width), then runs ``compress quantize`` (or ``prune``) on
it twice in child processes: all block inputs in memory, and at most ``--budget`` of them (the rest in a file
beside the output). Prints each run's peak RSS (the engine's figure), its time, the activations' size per copy
(``samples x seq_len x width x 4`` bytes; propagation holds the inputs and the outputs of a block), and whether
both outputs hold the same tensors. ``--budget-only`` skips the all-in-memory run (for calibration sets whose
two copies would not fit in this machine's memory: 512 x 2048 x 2048 is 8.6 GB per copy).
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

REPO = Path(__file__).resolve().parents[1]


def random_model(width: int, blocks: int, directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import CALIB_TEXT, train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(CALIB_TEXT.read_text(encoding="utf-8"), vocab_size=2000)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=(width * 11 // 4 + 127) // 128 * 128,
                         num_hidden_layers=blocks, num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run(args, model: Path, out: Path, budget: str | None) -> tuple[dict, float]:
    command = "prune" if args.method in ("sparsegpt", "wanda") else "quantize"
    argv = [sys.executable, "-m", "compress.cli", command, str(model), "-o", str(out), "--method", args.method,
            "--calib", str(args.calib), "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--json"]
    if command == "prune":
        argv += ["--sparsity", "0.5"]
    if budget is not None:
        argv += ["--activation-memory", budget]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return json.loads(done.stdout), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--budget", default="64MB")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--budget-only", action="store_true", help="skip the all-in-memory run")
    corpus = REPO.parent / "shared/corpus/shakespeare/train.txt"  # 4.4 MB: enough text for hundreds of long windows
    ap.add_argument("--calib", type=Path, default=corpus if corpus.is_file() else REPO / "eval/assets/shakespeare-calib-slice.txt")
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = random_model(args.width, args.blocks, scratch / f"random-llama-{args.width}x{args.blocks}")
        copy_gb = args.samples * args.seq_len * args.width * 4 / 1e9
        print(f"model {model.name}, {args.method}, calibration {args.samples} x {args.seq_len}: block inputs {copy_gb:.2f} GB per copy")
        print("\n| activation memory | peak RSS GB | wall s |\n|---|---:|---:|")
        outputs = {}
        for budget in ((args.budget,) if args.budget_only else (None, args.budget)):
            out = scratch / f"out-{budget}"
            summary, wall = run(args, model, out, budget)
            outputs[budget] = load_file(out / "model.safetensors")
            print(f"| {budget or 'all in memory'} | {summary['peak_rss_bytes'] / 1e9:.2f} | {wall:.1f} |")
        if args.budget_only:
            return
        a, b = outputs.values()
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        print(f"\nboth outputs hold the same tensors: {same}")


if __name__ == "__main__":
    main()
