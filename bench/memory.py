"""Peak memory of `compress quantize` on a checkpoint far larger than the memory bound.

Builds a random-initialised Llama checkpoint of >= 4 GB in fp32 (24 layers, hidden 2048; written
block by block, never whole in memory), quantizes it in a child process and prints the child's peak
RSS next to the checkpoint size. Target: peak RSS under 1.5 GB plus calibration activations.

    python bench/memory.py [--workdir /tmp/llm-compress-bench] [--method rtn] [--calib FILE --samples N --seq-len L]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 24, 2048, 5632, 16, 8, 32000


def build_checkpoint(out: Path, seed: int = 0) -> int:
    """Write config.json, a tokenizer and one safetensors shard per block; return the bytes written."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import CALIB_TEXT, train_tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    )
    config.save_pretrained(out)
    tokenizer = train_tiny_tokenizer(CALIB_TEXT.read_text(encoding="utf-8"), vocab_size=2000)
    tokenizer.save_pretrained(out)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    head_dim = HIDDEN // HEADS
    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": rand(VOCAB, HIDDEN)}]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shards.append({
            p + "self_attn.q_proj.weight": rand(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        })
    shards.append({"model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN)})
    weight_map, total = {}, 0
    for n, tensors in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({k: name for k in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(f.stat().st_size for f in out.iterdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llm-compress-bench"))
    ap.add_argument("--method", default="rtn")
    ap.add_argument("--calib", type=Path)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and output for another run")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_only:
        build_checkpoint(args.workdir / "llama-24x2048-fp32")
        return

    src, dst = args.workdir / "llama-24x2048-fp32", args.workdir / "out"
    if not (src / "model.safetensors.index.json").is_file():
        # Built in a child process: a child's peak RSS counts its parent's at fork time, so this
        # process must stay small for RUSAGE_CHILDREN to measure the quantizer alone.
        start = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--build-only", "--workdir", str(args.workdir)], check=True)
        print(f"built {src} in {time.perf_counter() - start:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in src.iterdir())
    cmd = [sys.executable, "-m", "compress.cli", "quantize", str(src), "-o", str(dst), "--method", args.method,
           "--bits", "4", "--group-size", "128", "--overwrite", "--json"]
    if args.calib:
        cmd += ["--calib", str(args.calib), "--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"quantize failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result = json.loads(proc.stdout)
    print(f"method                {args.method} (4-bit g128)")
    print(f"checkpoint size       {size / 2**30:.2f} GiB ({LAYERS} layers, hidden {HIDDEN}, fp32)")
    print(f"output size           {result['output_bytes'] / 2**30:.2f} GiB")
    print(f"peak RSS (child)      {peak / 2**30:.2f} GiB  ({peak / size:.1%} of the checkpoint; target < 1.5 GiB + activations)")
    print(f"peak RSS (engine)     {result['peak_rss_bytes'] / 2**30:.2f} GiB  (the quantizer's own report)")
    print(f"wall time             {wall:.0f} s ({result['seconds']:.0f} s in the engine)")
    if not args.keep:
        shutil.rmtree(dst, ignore_errors=True)


if __name__ == "__main__":
    main()
