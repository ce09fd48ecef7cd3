"""Bit allocation: one candidate per layer, the lowest predicted cost under a byte budget (or the
smallest size under a cost ceiling), as a multiple-choice knapsack solved by dynamic programming.

Problem (the multiple-choice knapsack; Kellerer, Pferschy, Pisinger, "Knapsack Problems", 2004, ch. 11).
Layer ``l`` has options ``k`` with a size ``s[l][k]`` (bytes) and a cost ``c[l][k]`` (e.g. the predicted
KLD increase when only that layer is quantized that way; costs are assumed additive over layers):

    minimize   Σ_l c[l][k_l]     subject to   Σ_l s[l][k_l] <= budget            (`minimize_cost`)
    minimize   Σ_l s[l][k_l]     subject to   Σ_l c[l][k_l] <= max_cost          (`minimize_size`)

Method. Only the bytes above each layer's smallest option are allocated (``e[l][k] = s[l][k] − min_k
s[l][k]``). They are counted in units of ``u = ceil(room / steps)`` bytes, each option's extra rounded
*up* to whole units, and ``best[l][b]`` (the lowest cost of layers ``0..l`` within ``b`` units) is filled
layer by layer: ``best[l][b] = min_k best[l−1][b − ⌈e[l][k]/u⌉] + c[l][k]``. Rounding up keeps every
answer within the true budget; the price is a bounded loss, reported as ``slack``:

- `minimize_cost`: the answer costs at most the exact optimum under ``budget − slack`` bytes;
- `minimize_size`: the answer is at most ``slack`` bytes larger than the exact smallest size;

with ``slack = u · (layers with a choice)``, and ``slack = 0`` (exact) whenever ``u = 1``, i.e. when the
room above the smallest allocation is at most ``steps`` bytes. Time ``O(layers · options · steps)``,
memory ``layers · steps`` bytes for the choices. Options dominated by another (no smaller and no cheaper)
are dropped first; ties go to the smaller option.

Inputs are sequences per layer (sizes: non-negative ints, costs: finite floats); nothing is modified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from compress.errors import CompressError

DEFAULT_STEPS = 1 << 16


@dataclass(frozen=True)
class Allocation:
    choice: tuple[int, ...]  # the chosen option index of each layer
    size: int  # Σ sizes of the chosen options (bytes, exact)
    cost: float  # Σ costs of the chosen options
    unit: int  # bytes per dynamic-programming step (1: exact)
    slack: int  # the discretization bound in bytes (see the module docstring); 0 when exact


def _check(sizes: Sequence[Sequence[int]], costs: Sequence[Sequence[float]]) -> None:
    if len(sizes) != len(costs):
        raise ValueError(f"{len(sizes)} layers of sizes but {len(costs)} of costs")
    for layer, (s, c) in enumerate(zip(sizes, costs)):
        if not s or len(s) != len(c):
            raise ValueError(f"layer {layer}: {len(s)} sizes and {len(c)} costs (need the same, at least one)")
        if min(s) < 0 or not all(math.isfinite(x) for x in c):
            raise ValueError(f"layer {layer}: sizes must be >= 0 and costs finite")


def _frontier(sizes: Sequence[int], costs: Sequence[float]) -> list[int]:
    """Indices of the options no other option beats, by increasing size (ties: the smaller, then first)."""
    order = sorted(range(len(sizes)), key=lambda k: (sizes[k], costs[k], k))
    kept: list[int] = []
    for k in order:
        if not kept or costs[k] < costs[kept[-1]]:
            kept.append(k)
    return kept


def _solve(sizes, costs, room: int, steps: int, whole: bool):
    """The DP over ``room`` extra bytes (``whole``: over all the room every layer's largest option
    takes once rounded up); returns (frontiers, units per option, unit, best, choices)."""
    fronts = [_frontier(s, c) for s, c in zip(sizes, costs)]
    unit = max(1, -(-room // steps))
    capacity = room // unit
    if whole:
        capacity = sum(-(-(sizes[l][f[-1]] - sizes[l][f[0]]) // unit) for l, f in enumerate(fronts))
    best = np.zeros(capacity + 1)  # no layers yet: cost 0 within any room
    choices = np.zeros((len(sizes), capacity + 1), dtype=np.int16 if max(map(len, fronts), default=1) > 127 else np.int8)
    units = []
    for layer, front in enumerate(fronts):
        base = sizes[layer][front[0]]
        extra = [-(-(sizes[layer][k] - base) // unit) for k in front]
        units.append(extra)
        new = np.full(capacity + 1, np.inf)
        arg = choices[layer]
        for j, (k, e) in enumerate(zip(front, extra)):
            if e > capacity:
                break  # larger options only need more room
            candidate = best[: capacity + 1 - e] + costs[layer][k]
            better = candidate < new[e:]
            new[e:][better] = candidate[better]
            arg[e:][better] = j
        best = new
    return fronts, units, unit, best, choices


def _pick(fronts, units, choices, b: int) -> list[int]:
    picked = [0] * len(fronts)
    for layer in range(len(fronts) - 1, -1, -1):
        j = int(choices[layer][b])
        picked[layer] = fronts[layer][j]
        b -= units[layer][j]
    return picked


def _result(sizes, costs, picked: list[int], unit: int) -> Allocation:
    size = sum(int(sizes[l][k]) for l, k in enumerate(picked))
    cost = float(sum(costs[l][k] for l, k in enumerate(picked)))
    varying = sum(1 for s in sizes if len(set(s)) > 1)
    return Allocation(tuple(picked), size, cost, unit, 0 if unit == 1 else unit * varying)


def minimize_cost(
    sizes: Sequence[Sequence[int]], costs: Sequence[Sequence[float]], budget: int, steps: int = DEFAULT_STEPS
) -> Allocation:
    """The option per layer with the lowest total cost whose total size is at most ``budget`` bytes.

    Raises `CompressError` when even the smallest option of every layer exceeds the budget."""
    _check(sizes, costs)
    smallest = sum(min(s) for s in sizes)
    if budget < smallest:
        raise CompressError(
            f"budget {budget} bytes is below the smallest plan, {smallest} bytes (every layer at its smallest candidate): "
            "raise the budget or measure a smaller candidate"
        )
    fronts, units, unit, best, choices = _solve(sizes, costs, budget - smallest, steps, whole=False)
    return _result(sizes, costs, _pick(fronts, units, choices, len(best) - 1), unit)


def minimize_size(
    sizes: Sequence[Sequence[int]], costs: Sequence[Sequence[float]], max_cost: float, steps: int = DEFAULT_STEPS
) -> Allocation:
    """The option per layer with the smallest total size whose total cost is at most ``max_cost``.

    Raises `CompressError` when even the cheapest option of every layer costs more."""
    _check(sizes, costs)
    lowest = float(sum(min(c) for c in costs))
    tolerance = 1e-12 * max(1.0, abs(max_cost))  # sums in another order may differ in the last bits
    if lowest > max_cost + tolerance:
        raise CompressError(
            f"cost ceiling {max_cost:g} is below the lowest predicted cost, {lowest:g} (every layer at its best candidate): "
            "raise the ceiling or measure a larger candidate"
        )
    room = sum(max(s) - min(s) for s in sizes)
    fronts, units, unit, best, choices = _solve(sizes, costs, room, steps, whole=True)
    b = int(np.argmax(best <= max_cost + tolerance))  # best is non-increasing: the first room that fits
    return _result(sizes, costs, _pick(fronts, units, choices, b), unit)
