"""A minimal reproduction: vLLM's CPU attention stores FP8 (E4M3) keys and values rounded toward zero.

    ~/.cache/llm-compress/vllm-venv/bin/python bench/vllm_kv_rounding.py [--json]

Runs in the vLLM venv (`bench/anchors/vllm_venv.py`) and imports nothing of ours. It writes random values through
the op vLLM's CPU backend calls to fill its cache (``cpu_attn_reshape_and_cache``, kv_cache_dtype ``fp8``, scale 1,
the ``vec`` layout of an x86 CPU without AMX), reads the stored bytes back as E4M3 and compares them with two
references computed here from the E4M3 value table: round to nearest (ties to even, torch's cast, what vLLM's CUDA
cache and compressed-tensors store) and round toward zero. ``--json`` prints the inputs and stored values instead.
"""

from __future__ import annotations

import argparse
import json

import torch


def stored_values(values: torch.Tensor) -> torch.Tensor:
    """``values [tokens, head_dim]`` (float32) as vLLM's CPU fp8 cache stores them (one KV head, one block)."""
    import vllm._custom_ops as ops

    tokens, head_dim = values.shape
    cache = torch.zeros(1, 1, 2 * tokens, head_dim, dtype=torch.uint8)  # [blocks, kv_heads, 2 * block_size, head_dim]
    key_cache, value_cache = cache.chunk(2, dim=2)
    x = values.reshape(tokens, 1, head_dim).contiguous()
    ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(tokens), "vec", 1.0, 1.0, "fp8")
    # the value cache is row-major within a block: token t's head_dim bytes at t * head_dim
    return value_cache.contiguous().view(-1)[: tokens * head_dim].view(torch.float8_e4m3fn).float().view(tokens, head_dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    values = torch.randn(32, 64) * 3
    stored = stored_values(values)
    if args.json:
        print(json.dumps({"values": values.tolist(), "stored": stored.tolist()}))
        return
    table = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite E4M3 value >= 0
    toward_zero = values.sign() * table[torch.searchsorted(table, values.abs(), right=True) - 1]
    nearest = values.to(torch.float8_e4m3fn).float()
    print(f"stored = round toward zero: {(stored == toward_zero).float().mean().item():.4f} of {values.numel()} values")
    print(f"stored = round to nearest:  {(stored == nearest).float().mean().item():.4f}")
    print(f"sum |stored| / sum |x|: {(stored.abs().sum() / values.abs().sum()).item():.4f} (round to nearest: {(nearest.abs().sum() / values.abs().sum()).item():.4f})")


if __name__ == "__main__":
    main()
