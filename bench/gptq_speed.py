"""GPTQ speed and reconstruction error per layer, beside the slow column-by-column reference.

    python bench/gptq_speed.py [--device cpu|cuda] [--shapes 4096x4096,4096x11008] [--skip-slow] [--gguf q4_k q2_k] [--repeat 3]

For each ``out x in`` shape: a random weight and ``H = 2/n X Xᵀ`` from correlated activations
(``X = Z A``, ``--tokens`` rows), quantized to 4 bit, group 128, symmetric. ``gptq`` (Cholesky
form, lazy batches) is timed beside the textbook reference from ``tests/references.py`` (full
inverse Hessian eliminated after every column, no blocks) run in float32 on the same device.
``rel_error`` = tr((W−Q) H (W−Q)ᵀ) / tr(W H Wᵀ); RTN is shown for scale. Each solve is timed ``--repeat`` times,
the fastest shown (and the slowest beside it), the reference once. ``--gguf TYPE...`` adds GPTQ
solved in those GGUF block types (`compress.quantizers.gguf_gptq`, CPU: its grid fits are numpy) beside
ggml's own rounding of the same weight; each is timed alone and with that comparison figure (``compare_rtn``, one more
encode of the layer, which an export's summary reports with ``-O compare_rtn=true``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from references import reference_obq  # noqa: E402

from compress.formats.gguf.plan import BASE, Target  # noqa: E402
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, gguf_gptq  # noqa: E402
from compress.quantizers.gptq import GPTQConfig, gptq  # noqa: E402
from compress.quantizers.grid import QuantScheme  # noqa: E402
from compress.quantizers.rtn import rtn  # noqa: E402


def layer(out_features: int, in_features: int, tokens: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g, device=device) * 0.02
    z = torch.randn(tokens, in_features, generator=g, device=device)
    a = torch.randn(in_features, in_features, generator=g, device=device) / in_features**0.5
    a += 0.1 * torch.eye(in_features, device=device)
    x = z @ a  # [tokens, in]: correlated input channels
    return w, 2.0 / tokens * (x.T @ x)


def rel_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = w - q
    return float(((d @ h) * d).sum() / ((w @ h) * w).sum())


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def fastest(fn, device: str, repeat: int):
    """``fn()``'s result and the fastest of ``repeat`` timed runs, with the slowest (a single run of a ~0.3 s solve
    moved by 10-20 % between runs on this 2-core machine, enough to flip a ratio against its target)."""
    runs = [timed(fn, device) for _ in range(max(1, repeat))]
    seconds = [t for _, t in runs]
    return runs[0][0], min(seconds), max(seconds)


def spread(fast: float, slow: float) -> str:
    return f" (slowest {slow:.3f})" if slow > fast else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--shapes", default="4096x4096,4096x11008", help="comma-separated OUTxIN")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--skip-slow", action="store_true", help="do not run the column-by-column reference")
    ap.add_argument("--gguf", nargs="*", default=[], choices=[t.value for t in Target], help="also GPTQ in these GGUF types")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each solve: the fastest is shown")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    scheme = QuantScheme(bits=args.bits, symmetric=True, group_size=args.group_size)
    config = GPTQConfig(scheme, block_size=args.block_size)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {name}, torch {torch.__version__}, w{args.bits} g{args.group_size} sym, "
          f"block {args.block_size}, {args.tokens} tokens, float32")
    head = f"{'layer':<12}{'method':<22}{'seconds':>10}{'rel_error':>12}"
    print(head)
    print("-" * len(head))
    for out_features, in_features in shapes:
        w, h = layer(out_features, in_features, args.tokens, args.device)
        shape = f"{out_features}x{in_features}"
        gptq(w[:8, : 2 * args.group_size], h[: 2 * args.group_size, : 2 * args.group_size], config)  # warm-up
        res, t_fast, slow = fastest(lambda: gptq(w, h, config), args.device, args.repeat)
        base = rtn(w, scheme)
        print(f"{shape:<12}{'rtn':<22}{'':>10}{rel_error(w, base.weight, h):>12.5f}")
        print(f"{shape:<12}{'gptq':<22}{t_fast:>10.3f}{res.stats['rel_error']:>12.5f}{spread(t_fast, slow)}", flush=True)
        for name in args.gguf:
            config_g = GGUFGPTQConfig(BASE[Target(name)], block_size=args.block_size, compare_rtn=False)
            alone, t_g, slow = fastest(lambda: gguf_gptq(w.cpu(), h.cpu(), config_g), "cpu", args.repeat)
            compared, t_c, _ = fastest(lambda: gguf_gptq(w.cpu(), h.cpu(), replace(config_g, compare_rtn=True)), "cpu", args.repeat)
            print(f"{shape:<12}{name + ' ggml rounding':<22}{'':>10}{compared.stats['rtn_rel_error']:>12.5f}")
            print(f"{shape:<12}{name + ' gptq':<22}{t_g:>10.3f}{alone.stats['rel_error']:>12.5f}  {t_g / t_fast:.2f}x gptq"
                  f"{spread(t_g, slow)}")
            print(f"{shape:<12}{name + ' gptq, compared':<22}{t_c:>10.3f}{'':>12}  {t_c / t_fast:.2f}x gptq (the export's default:"
                  " ggml's rounding measured too)", flush=True)
        if args.skip_slow:
            continue
        ref, t_slow = timed(
            lambda: reference_obq(w, h, args.bits, True, args.group_size, dtype=torch.float32), args.device
        )
        print(f"{shape:<12}{'reference (per col)':<22}{t_slow:>10.3f}{rel_error(w, ref['weight'], h):>12.5f}")
        print(f"{shape:<12}{'speed-up':<22}{t_slow / t_fast:>9.1f}x", flush=True)


if __name__ == "__main__":
    main()
