"""The process's glibc allocator settings, a policy per command: set by the CLI (the process owner), not the library."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

from compress.quantizers.reuse import REUSE

M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_ARENA_MAX = -3, -1, -8  # mallopt's parameters (malloc.h)


@dataclass(frozen=True)
class AllocatorPolicy:
    """glibc's malloc settings for the process: allocations of ``mmap_threshold`` bytes or more get their own
    mapping, returned to the OS when freed; ``trim_threshold`` (None: glibc's) is how much free memory the heap's
    top may keep instead of returning it; ``arenas`` (None: glibc's, 8 per core) caps the heaps threads allocate from.
    ``window_chunks``: the heap serves the one pass's chunks of windows, so the run should ask the engine for them
    (`compress.engine.block_engine.Engine`). ``reused_bytes``: how much of the large buffers no tensor uses any more
    `compress.quantizers.pages` keeps for the next request of their size, instead of the kernel's fresh pages."""

    mmap_threshold: int
    trim_threshold: int | None = None
    arenas: int | None = None
    window_chunks: bool = False
    reused_bytes: int = 0


# Long-lived block-sized tensors (quantize, prune, eval, ...): glibc raises its mmap threshold (up to 32 MB) after
# large frees, block-sized tensors then come from the heap and fragment it. Measured on the 24-layer bench: RSS grew
# ~30 MB per block (peak 1.42 GiB) with the default, and stayed flat (peak 0.78 GiB) with 1 MB.
# The data-free run's large buffers (a layer's weight as read, its codes, its packed words: 8 MB and more, every block
# the same few sizes) are kept for reuse, up to 1 GiB (`compress.quantizers.pages`): RTN of the 32-block Llama-3-8B-shaped
# model, alternating, 40.5 / 40.0 s against 49.4 / 43.7 s with a fresh mapping each, peak RSS 1.63 / 1.56 GB.
FRUGAL = AllocatorPolicy(mmap_threshold=1 << 20, reused_bytes=1 << 30)
# GGUF encoding: every chunk of weights makes the same few-MB temporaries again; under FRUGAL each one of 1 MB or more
# was a fresh mapping, page-faulted in and unmapped, and the heap's top was returned to the OS past 128 KB free and
# faulted in again by the next chunk. One thread, 2816 x 2048 F16 in memory, MB/s under FRUGAL / this: Q8_0 228 / 791,
# Q6_K 32 / 64, Q4_K 27 / 34. `compress export` of the TinyLlama-shaped bench model, alternating: Q4_K_M 11.4-12.1 ->
# 10.6-10.7 s, Q6_K 10.1-10.3 -> 9.0-9.3 s, Q8_0 6.2-6.5 -> 5.3-5.6 s, peak RSS +0 / +70 / +60 MB (of 1.3-1.4, 0.9 GB);
# with GPTQ (SmolLM2's first 8 blocks, 32 x 512 calibration tokens, q4_k) 31.3 -> 25.7-28.2 s, peak RSS 1.28 -> 1.40 GB
# (an 8 MB threshold: 1.50 GB). `compress measure` encodes every layer in every candidate: SmolLM2's first 8 blocks,
# q4_0,q8_0,q4_1,q5_0, 16 x 256: 164-179 -> 149-150 s, peak RSS 3.32 -> 3.50 GB.
STREAMING = AllocatorPolicy(mmap_threshold=4 << 20, trim_threshold=64 << 20)
# Calibrated compression (`recipe_policy`: quantize or prune with --calib by GPTQ, SparseGPT, AWQ, ...): the one pass runs its windows
# in chunks whose temporaries stay under 15 MiB (`compress.engine.one_pass.CHUNK_BYTES`), so that from the heap the next
# chunk reuses their pages; under FRUGAL each would be a fresh mapping, page-faulted in (3.3 M faults, 7.2 s of system
# time in GPTQ on SmolLM2's first 8 blocks, 32 x 512 tokens, about a fifth of the run; the heap costs ~0.1-0.2 GB of
# peak RSS). One arena: glibc gives each thread that allocates a heap of its own. The heap's top keeps up to 512 MB and
# serves allocations up to 64 MB, as CALIBRATED_EXPORT's: `compress quantize --method gptq` of the bfloat16 SmolLM2,
# 32 x 512 tokens, alternating, with glibc's trim threshold and a 16 MB mmap threshold / with these: 0.78-1.02 /
# 0.22-0.24 M faults, system time 2.7-3.3 / 1.7-1.8 s, wall 29.8-31.1 / 28.9-30.6 s, peak RSS 1.01-1.06 / 1.04-1.10 GB.
CALIBRATING = AllocatorPolicy(mmap_threshold=64 << 20, trim_threshold=512 << 20, arenas=1, window_chunks=True)
# A calibrated GGUF export (`compress export --method gptq/awq/awq-gptq/autoround`, or imatrix with --calib): the
# calibration's forward passes are the hot loop, in chunks of windows as under CALIBRATING, then the file's encoding
# as under STREAMING (its few-MB temporaries from the heap, whose top keeps 64 MB). Whole SmolLM2, q4_k_m by GPTQ,
# 32 x 512 tokens, one thread: under STREAMING (one batch of 32 windows, every MLP temporary a fresh mapping)
# 9.6 M page faults, 22.6 s of system time of 115 CPU seconds; under this (chunks of 5 windows) 1.2 M and 3.8 s, the
# same file, peak RSS 1.39 -> 2.11 GB (the chunks' paused forwards, and the heap keeping what they freed). The heap's
# top keeps up to 512 MB and serves allocations up to 64 MB: with a 64 MB top and a 16 MB mmap threshold, each block's
# end freed more than the top kept, and the next block faulted its pages in again (bfloat16 SmolLM2, 2 threads,
# alternating, 3 runs each, those settings / these: 1.0-1.4 / 0.42-0.43 M faults, system time 3.3-4.2 / 2.1-2.3 s,
# wall 35.1-36.4 / 33.6-35.3 s, peak RSS 1.69-1.80 / 1.71-1.74 GB).
CALIBRATED_EXPORT = AllocatorPolicy(mmap_threshold=64 << 20, trim_threshold=512 << 20, arenas=1, window_chunks=True)
COMMAND_ALLOCATOR = {"export": STREAMING, "measure": STREAMING}


def allocator_policy(command: str | None) -> AllocatorPolicy:
    """The policy ``compress COMMAND`` starts under (``compress run`` takes export's for a recipe with an ``export:``
    section, for the whole run: its encoding is the hot loop there too); ``compress export`` with calibration text
    switches to `CALIBRATED_EXPORT` once it has read its options."""
    return COMMAND_ALLOCATOR.get(command, FRUGAL)


def recipe_policy(recipe) -> AllocatorPolicy | None:
    """The policy a recipe's run switches to once the command has read it (None: it keeps the command's): export's
    for a recipe with an ``export:`` section (its GGUF encoding is the hot loop, for the whole run), `CALIBRATING` for one whose methods collect statistics on calibration data (GPTQ, SparseGPT, ...
    in the one pass; AWQ, whose passes run batch by batch, in batches of the one pass's chunk size: `Engine.pass_batch`)."""
    if recipe.export is not None:
        return STREAMING
    if recipe.calibration is not None and recipe.distill is None and any(stage.build().needs for stage in recipe.stages):
        return CALIBRATING
    return None


def set_allocator(policy: AllocatorPolicy) -> None:
    """Apply ``policy`` to this process (glibc only; elsewhere nothing). A process-wide setting, so the CLI (the
    process owner) makes it, not the library."""
    REUSE.set_limit(policy.reused_bytes)
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, policy.mmap_threshold)
        if policy.trim_threshold is not None:
            libc.mallopt(M_TRIM_THRESHOLD, policy.trim_threshold)
        if policy.arenas is not None:
            libc.mallopt(M_ARENA_MAX, policy.arenas)
    except (OSError, AttributeError):
        pass  # not glibc
