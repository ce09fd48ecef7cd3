"""True-sequential in the propagation pass: when a block's statistics, solves and outputs can share one forward pass.

GPTQ's true-sequential statistics pass for a group of layers (q/k/v, o, gate/up, down) sees the block's input
with the groups before it already transformed; so does the propagation pass once every group is. One forward
pass over all calibration windows in a single batch, each group transformed just before its first layer runs
(`compress.engine.passes.run_solving`), therefore collects every group's statistics and yields the compressed
block's outputs: about 1 block forward where the statistics passes cost about 2 and propagation 1. It needs
the windows in one batch, so it is taken where that batch's forward pass fits in memory (`one_pass_bytes`), by
methods that transform each layer alone from its input statistics (a method that rescales a norm, like AWQ, or
replays the block, changes what already ran).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch
from torch import nn

from compress.checkpoints.model_io import get_weight
from compress.engine.passes import CallOrder, run_solving
from compress.engine.statistics import Stat, StatsCollector

log = logging.getLogger(__name__)


def one_pass_bytes(layers: dict[str, nn.Module], windows: int, seq_len: int, element: int, heads: int = 0) -> int:
    """About the memory a block's forward pass takes on ``windows`` windows in one batch: per token the
    residual, normed input, attention output and query (4 model widths), 3 of the widest layer's (an MLP's
    gate, up and product), and eager attention's scores and probabilities (2 x heads x seq_len)."""
    shapes = [tuple(get_weight(module).shape) for module in layers.values()]
    hidden, widest = min(inputs for _, inputs in shapes), max(max(shape) for shape in shapes)  # [out, in]
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


def solve_while_propagating(block: nn.Module, batch, order: CallOrder, needs_of: Callable[[dict], frozenset[Stat]],
                            solve_group: Callable[[dict, StatsCollector], list]) -> tuple[list, torch.Tensor]:
    """``block`` run once on ``batch`` (``(hidden, args, kwargs)``: every window), each of ``order``'s groups
    transformed by ``solve_group(group, collector)`` from the statistics of the input it is about to be fed
    (``needs_of(group)``): the reports and the compressed block's output. Raises `CallsDiverged` as
    `run_solving` does."""
    reports: list = []

    def solve(k: int, x: torch.Tensor) -> None:
        group = order.groups[k]
        collector = StatsCollector(group, needs_of(group), order.same_input)
        for name in group:
            collector.feed(name, x)
        with torch.inference_mode(False):  # solve as the pass-by-pass engine does, outside the forward's mode
            reports.extend(solve_group(group, collector))

    return reports, run_solving(block, batch, order.groups, solve)


def first_window(value, batch: int):
    """``value`` (a tensor, or tuples, lists and dicts of them) cut to its first window wherever a tensor's first
    dimension is the ``batch`` size: a cheap sample of a one-batch capture, to learn a block's call order on."""
    if isinstance(value, torch.Tensor):
        return value[:1] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(first_window(v, batch) for v in value)
    if isinstance(value, dict):
        return {k: first_window(v, batch) for k, v in value.items()}
    return value
