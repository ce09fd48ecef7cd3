"""Int4 dequant kernels on a GPU: W4A16 GEMM time next to a bf16 ``torch.matmul``, and weight bandwidth.

    python bench/kernel_speed.py [--layout pack-quantized|gptq] [--group-size 128] [--batches 1 4 16 64 256] [--cuda-ext]
                                [--skip-float] [--skip-gguf]

For the linear shapes of a 7B/8B Llama (out×in: 4096×4096, 11008×4096, 4096×11008, 14336×4096,
4096×14336) and each batch: time of ``triton_int.matmul`` (gemv up to batch 4, fused dequant-GEMM up to 16,
dequantize + matmul above; at gemv's batches the fused kernel's time beside it), time of ``torch.matmul`` with the bf16 weight, the speedup, and the effective bandwidth of
the packed weight traffic (packed words + scales [+ zeros] bytes / time) as a fraction of the device's
measured copy bandwidth (a 1 GiB device-to-device copy: read + write bytes / time). Targets (Marlin's
published figures, ~3.9× over fp16 up to batch 16, are the anchor): ≥ 3× at batch 1, ≥ 80% of copy bandwidth.

Before timing, each shape is checked: the Triton dequant equals the torch reference bit for bit (float32),
the GEMM is close to bf16 ``torch.matmul`` on the same weight; ``--cuda-ext`` also builds and checks the
CUDA C++ dequant. Then the GGUF dequant kernels' output bandwidth on a 4096×4096 tensor.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336)]  # (out, in)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device copy, counting read + write."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def timed(fn) -> tuple[float, float]:
    """(eager ms, CUDA-graph ms) of ``fn``: eager time includes Python's launch overhead, which dominates small
    decode GEMMs; replayed from a CUDA graph (how vLLM runs decode) only the GPU work counts."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()  # autotune / compile outside the timings and the graph capture
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200), do_bench_cudagraph(fn, rep=100)


def random_layer(layout: str, out_f: int, in_f: int, group_size: int, seed: int):
    """(tensors, torch reference dequantizer, descriptor) of random 4-bit codes and scales, on the GPU."""
    from compress.formats import compressed_tensors as ct
    from compress.formats import gptq
    from compress.kernels.layouts import describe_gptq, describe_pack_quantized

    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = in_f // group_size
    scales = (torch.rand(groups, out_f, generator=g, device="cuda") * 0.02 + 0.001)
    if layout == "gptq":
        tensors = {
            "qweight": torch.randint(-2**31, 2**31 - 1, (in_f // 8, out_f), generator=g, device="cuda", dtype=torch.int32),
            "qzeros": torch.randint(-2**31, 2**31 - 1, (groups, out_f // 8), generator=g, device="cuda", dtype=torch.int32),
            "scales": scales.half(),
            "g_idx": (torch.arange(in_f, device="cuda") // group_size).int(),
        }
        return tensors, functools.partial(gptq.dequantize, bits=4, group_size=group_size), describe_gptq(tensors, 4, group_size)
    tensors = {
        "weight_packed": torch.randint(-2**31, 2**31 - 1, (out_f, in_f // 8), generator=g, device="cuda", dtype=torch.int32),
        "weight_scale": scales.t().contiguous().bfloat16(),
        "weight_shape": torch.tensor([out_f, in_f]),
    }
    deq = functools.partial(ct.dequantize_pack_quantized, bits=4, symmetric=True)
    return tensors, deq, describe_pack_quantized(tensors, 4, True)


def weight_bytes(desc) -> int:
    parts = [desc.words, desc.scales] + ([desc.zeros] if desc.zeros is not None else [])
    return sum(t.numel() * t.element_size() for t in parts)


def check(tensors, reference, desc, use_cuda_ext: bool) -> None:
    from compress.kernels import triton_int

    expected = reference(tensors)
    if not torch.equal(triton_int.dequantize(desc), expected.contiguous()):
        raise SystemExit("FAIL: Triton dequant differs from the torch reference")
    if use_cuda_ext:
        from compress.kernels import cuda_ext

        if not torch.equal(cuda_ext.dequantize(desc), expected.contiguous()):
            raise SystemExit("FAIL: CUDA C++ dequant differs from the torch reference")
    w = expected.bfloat16()
    for m in (1, 4, 16, 64):
        x = torch.randn(m, desc.in_features, device="cuda", dtype=torch.bfloat16)
        y, ref = triton_int.matmul(x, desc).float(), (x @ w.t()).float()
        err = ((y - ref).norm() / ref.norm()).item()
        if err > 1e-2:
            raise SystemExit(f"FAIL: W4A16 GEMM at batch {m} is off the bf16 matmul by {err:.2e} (relative)")


def bench_gguf(copy_gbs: float) -> None:
    import numpy as np
    from triton.testing import do_bench

    from compress.kernels.triton_gguf import GGUFBlock, dequantize

    print("\nGGUF dequant, 4096x4096 (output float32 written + blocks read)")
    print("| type | ms | GB/s | % of copy |")
    print("|---|---:|---:|---:|")
    for block in GGUFBlock:
        elems, size = block.elems, block.size
        n_blocks = 4096 * 4096 // elems
        data = torch.from_numpy(np.random.default_rng(0).integers(0, 256, n_blocks * size, dtype=np.uint8)).cuda()
        ms = do_bench(lambda: dequantize(data, block), warmup=25, rep=200)
        gbs = (data.numel() + n_blocks * elems * 4) / (ms * 1e-3) / 1e9
        print(f"| {block.name} | {ms:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |")


def bench_float() -> None:
    """FP8 (per channel, 128x128 blocks) and NVFP4 on 4096x4096: dequant + matmul time next to bf16."""
    from compress.formats import ct_float
    from compress.kernels import triton_float
    from compress.kernels.layouts import describe_float
    from compress.quantizers.float_grid import FloatGrid, FloatScheme
    from compress.quantizers.rtn import rtn

    print("\nFloat layouts, 4096x4096, bf16 activations (weight dequantized to bf16, then F.linear)")
    print("| scheme | batch | ms (graph) | bf16 matmul ms (graph) | speedup (graph) | speedup (eager) |")
    print("|---|---:|---:|---:|---:|---:|")
    w = torch.randn(4096, 4096, device="cuda") * 0.02
    dense = w.bfloat16()
    for name, scheme, block in [("fp8-channel", FloatScheme(FloatGrid.FP8, -1), None),
                                ("fp8-block", FloatScheme(FloatGrid.FP8, 128, 128), (128, 128)),
                                ("nvfp4", FloatScheme(FloatGrid.NVFP4, 16), None)]:
        tensors = ct_float.tensors(rtn(w, scheme))
        desc = describe_float(tensors, scheme.grid, block)
        for m in (1, 16, 256):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            (ms, ms_g), (base, base_g) = timed(lambda: triton_float.matmul(x, desc)), timed(lambda: x @ dense.t())
            print(f"| {name} | {m} | {ms_g:.4f} | {base_g:.4f} | {base_g / ms_g:.2f}x | {base / ms:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["pack-quantized", "gptq"], default="pack-quantized")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--cuda-ext", action="store_true", help="also build and check the CUDA C++ dequant")
    parser.add_argument("--skip-gguf", action="store_true")
    parser.add_argument("--skip-float", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernel_speed.py needs a CUDA GPU (Triton kernels); none found: nothing to measure.")
        sys.exit(0)
    from compress.kernels import triton_int

    copy_gbs = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    print(f"layout: {args.layout}, 4-bit, group {args.group_size}; activations bf16\n")
    print("| out x in | batch | W4A16 ms (graph) | bf16 matmul ms (graph) | speedup (graph) | speedup (eager) "
          "| weight GB/s (graph) | % of copy | fused kernel ms (graph, speedup) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, (out_f, in_f) in enumerate(SHAPES):
        tensors, reference, desc = random_layer(args.layout, out_f, in_f, args.group_size, seed=i)
        check(tensors, reference, desc, args.cuda_ext)
        dense = reference(tensors).bfloat16().contiguous()
        nbytes = weight_bytes(desc)
        for m in args.batches:
            x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
            (ms, ms_g), (base, base_g) = timed(lambda: triton_int.matmul(x, desc)), timed(lambda: x @ dense.t())
            gbs = nbytes / (ms_g * 1e-3) / 1e9
            # at decode batches matmul runs gemv; the fused tl.dot kernel beside it, as before gemv existed
            fused = timed(lambda: triton_int.fused_matmul(x, desc))[1] if m <= triton_int.GEMV_MAX_M else None
            fused = f"{fused:.4f} ({base_g / fused:.2f}x)" if fused else "-"
            print(f"| {out_f}x{in_f} | {m} | {ms_g:.4f} | {base_g:.4f} | {base_g / ms_g:.2f}x | {base / ms:.2f}x "
                  f"| {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {fused} |")
        tuned = {name: getattr(kernel, "best_config", None) for name, kernel in
                 [("gemv", triton_int._gemv_tuned), ("fused", triton_int._fused_tuned), ("dequant", triton_int._dequant_tuned)]}
        print("|   | tuned | " + " | ".join(f"{k}: {c.kwargs if c else '-'} {f'w{c.num_warps}' if c else ''}"
                                          for k, c in tuned.items()) + " | | | | | |")
    if not args.skip_float:
        bench_float()
    if not args.skip_gguf:
        bench_gguf(copy_gbs)


if __name__ == "__main__":
    main()
