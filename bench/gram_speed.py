"""Hessian sums of bfloat16 windows: the compiled loop (`compress.quantizers.gram`) beside torch's float32 products.

    python bench/gram_speed.py [--widths 576 1536 4096 14336] [--windows 8] [--tokens 512] [--repeat 3]

For each width: ``--windows`` random bfloat16 windows of ``--tokens`` tokens (one outlier channel), their upper
Gram triangle added to a float64 total by the compiled loop (AVX512-BF16: exact pair products, each window's sum in
float32) and by `compress.engine.statistics.add_upper_gram_` on their float32 copy (torch's products, the path every
other CPU takes), on torch's thread count. Prints the fastest of ``--repeat`` timings of each, its rate in GFLOP/s
(two per multiply-add of the upper triangle: windows x tokens x width² flops), their ratio, and the largest
difference of the two totals relative to the float64 product's largest entry. Where the compiled loop does not run
(no AVX512-BF16, no C compiler) it says so and times torch's alone.
"""

from __future__ import annotations

import argparse
import time

import torch

from compress.engine.statistics import GramScratch, add_upper_gram_
from compress.quantizers import gram


def fastest(run, repeat: int) -> float:
    run()  # warm: buffers, the library's first load
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[576, 1536, 4096, 14336])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.get_num_threads()} threads, {args.windows} windows of {args.tokens} tokens, fastest of {args.repeat}")
    print("| width | compiled | GFLOP/s | torch float32 | GFLOP/s | torch / compiled | max difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for width in args.widths:
        g = torch.Generator().manual_seed(width)
        x = torch.randn(args.windows, args.tokens, width, generator=g)
        x[..., 3] *= 40.0
        x = x.bfloat16()
        flops = args.windows * args.tokens * width * width
        wide, scratch = x.float(), GramScratch()
        ours = torch.zeros(width, width, dtype=torch.float64)
        theirs = torch.zeros(width, width, dtype=torch.float64)
        t_torch = fastest(lambda: add_upper_gram_(theirs.zero_(), wide, scratch), args.repeat)
        if not gram.usable(ours, x):
            print(f"| {width} | does not run here | | {t_torch * 1e3:.1f} ms | {flops / t_torch / 1e9:.0f} | | |")
            continue
        packed = torch.empty(gram.packed_shape(x), dtype=torch.int32)
        t_ours = fastest(lambda: gram.add_upper_gram_bf16_(ours.zero_(), x, packed), args.repeat)
        upper = torch.ones(width, width, dtype=torch.bool).triu()
        diff = float((ours - theirs)[upper].abs().max() / theirs[upper].abs().max())
        print(f"| {width} | {t_ours * 1e3:.1f} ms | {flops / t_ours / 1e9:.0f} | {t_torch * 1e3:.1f} ms | "
              f"{flops / t_torch / 1e9:.0f} | {t_torch / t_ours:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
