"""The knapsack allocator against brute force (every combination enumerated) on seeded random instances."""

from __future__ import annotations

import itertools
import random

import pytest

from compress.errors import CompressError
from compress.quantizers.allocation import minimize_cost, minimize_size


def random_instance(rng: random.Random, layers: int, options: int, max_size: int = 400):
    sizes = [[rng.randint(1, max_size) for _ in range(rng.randint(1, options))] for _ in range(layers)]
    costs = [[rng.choice([rng.random(), round(rng.random(), 1)]) for _ in s] for s in sizes]  # some ties
    return sizes, costs


def all_plans(sizes, costs):
    for picked in itertools.product(*(range(len(s)) for s in sizes)):
        yield (sum(sizes[l][k] for l, k in enumerate(picked)), sum(costs[l][k] for l, k in enumerate(picked)), picked)


def brute_min_cost(sizes, costs, budget):
    return min((c for s, c, _ in all_plans(sizes, costs) if s <= budget), default=None)


def brute_min_size(sizes, costs, max_cost):
    return min((s for s, c, _ in all_plans(sizes, costs) if c <= max_cost + 1e-12), default=None)


def check_consistent(result, sizes, costs):
    assert result.size == sum(sizes[l][k] for l, k in enumerate(result.choice))
    assert result.cost == pytest.approx(sum(costs[l][k] for l, k in enumerate(result.choice)), abs=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_minimize_cost_is_exact_when_the_room_fits_the_steps(seed):
    rng = random.Random(seed)
    sizes, costs = random_instance(rng, rng.randint(1, 6), 4)
    lo, hi = sum(map(min, sizes)), sum(map(max, sizes))
    budget = rng.randint(lo, hi + 20)
    result = minimize_cost(sizes, costs, budget, steps=hi)  # unit 1: exact
    check_consistent(result, sizes, costs)
    assert result.slack == 0 and result.size <= budget
    assert result.cost == pytest.approx(brute_min_cost(sizes, costs, budget), abs=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_minimize_cost_keeps_its_discretization_bound(seed):
    rng = random.Random(1000 + seed)
    sizes, costs = random_instance(rng, rng.randint(2, 6), 4, max_size=5000)
    lo, hi = sum(map(min, sizes)), sum(map(max, sizes))
    budget = rng.randint(lo, hi)
    result = minimize_cost(sizes, costs, budget, steps=rng.choice([4, 16, 64]))
    check_consistent(result, sizes, costs)
    assert result.size <= budget  # rounding up never overspends
    exact = brute_min_cost(sizes, costs, budget)
    assert result.cost >= exact - 1e-12
    # the promised bound: no worse than the exact optimum with `slack` fewer bytes
    reference = brute_min_cost(sizes, costs, budget - result.slack)
    if reference is not None:
        assert result.cost <= reference + 1e-12


@pytest.mark.parametrize("seed", range(60))
def test_minimize_size_under_a_cost_ceiling(seed):
    rng = random.Random(2000 + seed)
    sizes, costs = random_instance(rng, rng.randint(1, 6), 4, max_size=3000)
    lowest, highest = sum(map(min, costs)), sum(map(max, costs))
    ceiling = rng.uniform(lowest, highest)
    steps = rng.choice([8, 64, 10**6])
    result = minimize_size(sizes, costs, ceiling, steps=steps)
    check_consistent(result, sizes, costs)
    assert result.cost <= ceiling + 1e-12
    exact = brute_min_size(sizes, costs, ceiling)
    assert exact <= result.size <= exact + result.slack
    if result.unit == 1:
        assert result.size == exact and result.slack == 0


def test_budget_below_the_smallest_plan_is_one_line():
    with pytest.raises(CompressError) as info:
        minimize_cost([[10, 20], [5, 7]], [[1.0, 0.5], [2.0, 1.0]], 14)
    message = str(info.value)
    assert "\n" not in message and "15 bytes" in message and "budget 14" in message


def test_ceiling_below_the_lowest_cost_is_one_line():
    with pytest.raises(CompressError) as info:
        minimize_size([[10, 20], [5, 7]], [[1.0, 0.5], [2.0, 1.0]], 1.0)
    assert "\n" not in str(info.value) and "1.5" in str(info.value)


def test_inputs_are_not_modified_and_ties_take_the_smaller_option():
    sizes, costs = [[30, 10, 20]], [[1.0, 1.0, 1.0]]
    result = minimize_cost(sizes, costs, 100)
    assert result.choice == (1,) and sizes == [[30, 10, 20]] and costs == [[1.0, 1.0, 1.0]]


def test_large_instance_is_fast_enough_and_within_bound():
    """A SmolLM2-sized problem (210 layers x 6 options, MB-sized layers) against a greedy lower bound."""
    rng = random.Random(7)
    sizes = [[int(rng.uniform(0.5, 1.5) * b * 100_000) for b in (2.5, 3.5, 4.5, 5.5, 6.5, 8.5)] for _ in range(210)]
    costs = [[rng.uniform(0.5, 2) * 4.0 ** -b for b in (2, 3, 4, 5, 6, 8)] for _ in range(210)]
    budget = sum(s[2] for s in sizes)
    result = minimize_cost(sizes, costs, budget)
    assert result.size <= budget
    assert result.cost <= sum(c[2] for c in costs)  # at least as good as every layer at option 2, which fits
    assert result.slack <= budget * 0.01
