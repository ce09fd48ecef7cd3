"""Causal bfloat16 self-attention: the compiled loop (`compress.kernels.cpu_attention`) beside torch's SDPA.

    python bench/attention_speed.py [--shapes 32x9x3x512x64 4x32x8x512x128 1x32x8x2048x128] [--repeat 3]

Each shape is ``batch x heads x kv_heads x tokens x dim`` (SmolLM2's 9 query heads over 3 kv heads of 64 in 32
windows of 512, a block's calibration batch; Llama-3-8B's 32 over 8 of 128), with random bfloat16 queries, keys and
values laid out as attention layers make them (``[batch, tokens, heads, dim]`` projections seen as ``[batch,
heads, tokens, dim]``). Both run on torch's thread count: ``scaled_dot_product_attention(..., is_causal=True,
enable_gqa=True)`` and `causal_attention_bf16`. Prints the fastest of ``--repeat`` timings of each, the rate in
GFLOP/s (the causal half of the two products: 2 x batch x heads x tokens² x dim), their ratio, the share of outputs
whose bits differ and the largest difference relative to the largest output. Where the compiled loop does not run (no
AVX512-BF16, no C compiler) it says so and times torch's alone.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from gram_speed import fastest

from compress.kernels import cpu_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["32x9x3x512x64", "4x32x8x512x128", "1x32x8x2048x128"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.get_num_threads()} threads, fastest of {args.repeat}")
    print("| batch x heads x kv heads x tokens x dim | compiled | GFLOP/s | torch SDPA | GFLOP/s | SDPA / compiled | outputs differing | max difference / max output |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        batch, heads, kv_heads, tokens, dim = (int(n) for n in shape.split("x"))
        g = torch.Generator().manual_seed(tokens)
        q, k, v = (torch.randn(batch, tokens, n, dim, generator=g).bfloat16().transpose(1, 2) for n in (heads, kv_heads, kv_heads))
        flops = 2 * batch * heads * tokens * tokens * dim
        scale = dim**-0.5
        t_torch = fastest(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), args.repeat)
        if not cpu_attention.usable(q, k, v):
            print(f"| {shape} | does not run here | | {t_torch * 1e3:.1f} ms | {flops / t_torch / 1e9:.0f} | | | |")
            continue
        t_ours = fastest(lambda: cpu_attention.causal_attention_bf16(q, k, v, scale), args.repeat)
        ours = cpu_attention.causal_attention_bf16(q, k, v, scale).float()
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).float()
        differing = float((ours != theirs).double().mean())
        relative = float((ours - theirs).abs().max() / theirs.abs().max())
        print(f"| {shape} | {t_ours * 1e3:.1f} ms | {flops / t_ours / 1e9:.0f} | {t_torch * 1e3:.1f} ms | "
              f"{flops / t_torch / 1e9:.0f} | {t_torch / t_ours:.2f} | {differing:.1%} | {relative:.1e} |")


if __name__ == "__main__":
    main()
