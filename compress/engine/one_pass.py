"""True-sequential in the propagation pass: when a block's statistics, solves and outputs can share one forward pass.

GPTQ's true-sequential statistics pass for a group of layers (q/k/v, o, gate/up, down) sees the block's input
with the groups before it already transformed; so does the propagation pass once every group is. One forward
pass over all calibration windows in a single batch, each group transformed just before its first layer runs
(`compress.engine.passes.run_solving`), therefore collects every group's statistics and yields the compressed
block's outputs: about 1 block forward where the statistics passes cost about 2 and propagation 1. It needs
the windows in one batch, so it is taken where that batch's forward pass fits in memory (`one_pass_bytes`), by
methods that transform each layer alone from its input statistics (a method that rescales a norm, like AWQ, or
replays the block, changes what already ran). That batch's forward runs in chunks of windows that take turns
(`window_chunks`, `compress.engine.turns`): the statistics and solves are those of the whole batch, but each
temporary is a chunk's, which the heap can reuse; the stages before the last run pass by pass over the same chunks,
or inside the pass where they declare the modules producing what they read (`Method.producers`: SmoothQuant's norms):
each such group is transformed as its producer is reached, from the producer's output there (`Prologue`), so
SmoothQuant's statistics cost no pass of their own and the MLP's smoothing reads the attention GPTQ has already
quantized; the engine's pass-by-pass path keeps that order too (a statistics pass up to the group before the last
stage's group it feeds), so both give the same tensors.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from compress.checkpoints.model_io import get_weight
from compress.engine.passes import CallOrder, run_solving
from compress.engine.statistics import Stat, StatsCollector

log = logging.getLogger(__name__)


# The one pass's windows run in chunks (`compress.engine.turns`) whose widest temporary (an MLP's gate, up or product
# output) stays within this: below the calibrating commands' mmap threshold (16 MiB, `compress.cli.allocator`), glibc
# serves it from its heap, where the next chunk reuses the pages, instead of mapping and zero-filling fresh ones for each.
CHUNK_BYTES = 15 << 20
MAX_CHUNKS = 16  # greenlets, one per chunk, each holding its paused forward pass; past this the chunks grow instead


def one_pass_bytes(layers: dict[str, nn.Module], windows: int, seq_len: int, element: int, heads: int = 0) -> int:
    """About the memory a block's forward pass takes on ``windows`` windows in one batch: per token the
    residual, normed input, attention output and query (4 model widths), 3 of the widest layer's (an MLP's
    gate, up and product), and eager attention's scores and probabilities (2 x heads x seq_len)."""
    hidden = min(get_weight(module).shape[1] for module in layers.values())  # [out, in]
    widest = _widest(layers)
    return windows * seq_len * element * (4 * hidden + 3 * widest + 2 * heads * seq_len)


def memory_for_one_pass(device: torch.device) -> int:
    """What a one-pass forward may take: a quarter of the machine's memory (CPU), half the device's free memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): pass by pass
        return 0


def one_pass_capable(methods: list) -> bool:
    """Every method true-sequential, transforming each layer alone (`Method.layerwise`) from its input statistics."""
    return all(m.needs and m.sequential and m.layerwise for m in methods)


def one_pass_batch(layers: dict[str, nn.Module], windows: torch.Tensor, config, dtype: torch.dtype,
                   allowed: int) -> bool:
    """Whether ``windows`` ``[samples, seq_len]`` may run through a block of ``layers`` in one batch within
    ``allowed`` bytes (``config``: the model's, for its attention heads)."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    element = torch.empty((), dtype=dtype).element_size()
    needed = one_pass_bytes(layers, windows.shape[0], windows.shape[1], element, heads)
    if needed > allowed:
        log.info("statistics pass by pass: one pass over all %d windows would take ~%.1f GB (%.1f GB allowed)",
                 windows.shape[0], needed / 1e9, allowed / 1e9)
    return needed <= allowed


def solve_while_propagating(block: nn.Module, chunks: list, order: CallOrder,
                            needs_of: Callable[[dict], frozenset[Stat]],
                            solve_group: Callable[[dict, StatsCollector], list],
                            prologues: list[Prologue] = (), through: bool = True) -> tuple[list, torch.Tensor | None]:
    """``block`` run once on every window (``chunks`` of ``(hidden, args, kwargs)`` batches, `window_chunks`), each of
    ``order``'s groups transformed by ``solve_group(group, collector)`` from the statistics of the input it is about
    to be fed (``needs_of(group)``), and before them each `Prologue`'s, just before its producer runs: the reports
    and the compressed block's output (None with ``through`` False: the windows stop once the last group is
    transformed, where nothing reads the block's output). Raises `CallsDiverged` as `run_solving` does."""
    reports: list = []

    def solve(k: int, xs: list[torch.Tensor]) -> None:
        group = order.groups[k]
        collector = StatsCollector(group, needs_of(group), order.same_input)
        for x in xs:  # the windows in order, as one batch would feed them
            for name in group:
                collector.feed(name, x)
        with torch.inference_mode(False):  # solve as the pass-by-pass engine does, outside the forward's mode
            reports.extend(solve_group(group, collector))

    def produce(prologue: Prologue, xs: list[torch.Tensor]) -> None:
        ys = [prologue.module.forward(x) for x in xs]  # its output on each chunk (`forward`: not its hooks again)
        with torch.inference_mode(False):
            reports.extend(prologue.solve(ys))

    groups, steps = [], []
    for k, group in enumerate(order.groups):
        for prologue in prologues:
            if group is first_group_reading(order.groups, prologue.readers):
                groups.append({prologue.name: prologue.module})
                steps.append(functools.partial(produce, prologue))
        groups.append(group)
        steps.append(functools.partial(solve, k))
    return reports, run_solving(block, chunks, groups, lambda k, xs: steps[k](xs), through)


@dataclass
class Prologue:
    """An earlier stage's group run inside the one pass (`Method.producers`): ``module`` (full name ``name``) produces
    the whole input of ``readers``; ``solve(outputs)`` transforms them from the module's output on each chunk, just
    before the module runs (its reports)."""

    name: str
    module: nn.Module
    readers: dict[str, nn.Module]
    solve: Callable[[list[torch.Tensor]], list]


def first_group_reading(groups: list[dict], readers: dict) -> dict | None:
    """The first of ``groups`` (call order) holding one of ``readers``: a producer of their input runs before it."""
    return next((g for g in groups if set(g) & set(readers)), None)


def fused_stages(stages: list, block: nn.Module, block_name: str, solved: dict[str, nn.Module]):
    """How ``stages`` (those before the one pass's, which solves ``solved``) may run inside the one pass: ``(upfront,
    groups)``, each stage's layers it transforms without statistics (first) and ``(stage, producer name, module,
    readers)`` per group it reads (`Method.producers`); None where one may not (it runs pass by pass first)."""
    upfront, groups = [], []
    prefix = block_name + "."
    for stage in stages:
        layers = {n: m for n, m in stage.layers.items() if n.startswith(prefix)}
        if not layers:
            continue
        declared = None if stage.overrides else stage.method.producers(block)
        if declared is None:
            return None
        covered: set[str] = set()
        for producer, names in declared:
            readers = {prefix + r: layers[prefix + r] for r in names if prefix + r in layers}
            taken = {g[1] for g in groups}
            if not readers:
                continue
            if not set(readers) <= set(solved) or prefix + producer in taken:
                return None  # read where the one pass does not stop, or a producer two stages would transform
            groups.append((stage, prefix + producer, block.get_submodule(producer), readers))
            covered |= set(readers)
        rest = {n: m for n, m in layers.items() if n not in covered}
        if any(stage.method.layer_needs(block, n[len(prefix):]) for n in rest):
            return None
        if rest:
            upfront.append((stage, rest))
    return upfront, groups


def _widest(layers: dict[str, nn.Module]) -> int:
    """The largest input or output width among ``layers``: a token's widest activation in their block."""
    return max(max(get_weight(module).shape) for module in layers.values())


def windows_per_chunk(layers: dict[str, nn.Module], seq_len: int, element: int) -> int:
    """The most windows whose widest layer's output stays within `CHUNK_BYTES` (at least one)."""
    return max(1, CHUNK_BYTES // (seq_len * _widest(layers) * element))


def window_chunks(layers: dict[str, nn.Module], windows: int, seq_len: int, element: int) -> list[slice]:
    """The windows cut into chunks (as even as may be, in order) of at most `windows_per_chunk`, at most `MAX_CHUNKS`
    of them."""
    count = min(MAX_CHUNKS, -(-windows // windows_per_chunk(layers, seq_len, element)))
    bounds = [windows * i // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def windows_of(value, batch: int, part: slice):
    """``value`` (a tensor, or tuples, lists and dicts of them) cut to the windows ``part`` wherever a tensor of 2 or
    more dimensions has the ``batch`` size first (a one-batch capture's arguments: hidden states, positions, masks;
    not a 1-D ``cache_position``)."""
    if isinstance(value, torch.Tensor):
        return value[part] if value.dim() > 1 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(windows_of(v, batch, part) for v in value)
    if isinstance(value, dict):
        return {k: windows_of(v, batch, part) for k, v in value.items()}
    return value


def first_window(value, batch: int):
    """`windows_of` the first window: a cheap sample of a one-batch capture, to learn a block's call order on."""
    return windows_of(value, batch, slice(0, 1))
