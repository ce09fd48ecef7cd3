"""`FixedTileProducts`: the same bits at any thread count (MKL's threaded product was not, on an AMD EPYC with
AVX-512: [37, 128] x [128, 37] moved between 1 and 3 threads, [5, 128] x [128, 16] between 1 and 2), the product
itself (against float64), and its in-place forms against the plain product written or subtracted."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.threads import TILE_COLUMNS, TILE_ROWS, FixedTileProducts, even_runs, share_runs

SHAPES = [(37, 128, 37), (5, 128, 16), (5, 128, 100), (300, 128, 100), (3 * TILE_ROWS + 7, 128, TILE_COLUMNS + 45)]


def operands(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)


def at_thread_counts(fn, counts=(1, 2, 3, 4)) -> list[torch.Tensor]:
    threads = torch.get_num_threads()
    try:
        results = []
        for count in counts:
            torch.set_num_threads(count)
            with FixedTileProducts(torch.device("cpu")) as product:
                results.append(fn(product))
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_same_bits_at_every_thread_count(shape):
    a, b = operands(*shape)
    results = at_thread_counts(lambda product: product(a, b))
    assert all(torch.equal(results[0], r) for r in results[1:])
    exact = a.double() @ b.double()
    assert (results[0].double() - exact).abs().max() <= 1e-5 * exact.abs().max()


@pytest.mark.parametrize("shape", SHAPES[-2:], ids=str)
def test_into_writes_and_subtracts_what_the_product_is(shape):
    a, b = operands(*shape)
    base = torch.randn(shape[0], shape[2], generator=torch.Generator().manual_seed(1))
    with FixedTileProducts(torch.device("cpu")) as product:
        plain = product(a, b)
        written = product(a, b, into=torch.zeros_like(base))
        subtracted = product(a, b, into=base.clone(), subtract=True)
        strided = torch.zeros(shape[0], shape[2] + 9)  # into a view whose rows are not contiguous
        product(a, b, into=strided[:, 4 : 4 + shape[2]])
    assert torch.equal(written, plain) and torch.equal(strided[:, 4 : 4 + shape[2]], plain)
    assert torch.equal(subtracted, base - plain)
    assert not strided[:, :4].any() and not strided[:, 4 + shape[2] :].any()


def test_the_thread_count_is_restored():
    threads = torch.get_num_threads()
    a, b = operands(*SHAPES[-1])
    with FixedTileProducts(torch.device("cpu")) as product:
        product(a, b)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("count, parts", [(1, 1), (7, 3), (288, 2), (5, 5), (1000, 7)])
def test_even_runs_cover_the_range_in_order_with_lengths_one_apart(count, parts):
    runs = even_runs(count, parts)
    assert len(runs) == parts and runs[0][0] == 0 and runs[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    lengths = [b - a for a, b in runs]
    assert max(lengths) - min(lengths) <= 1


def test_share_runs_gives_every_runs_result_in_order_using_the_pool():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    seen = {}

    def run(a, b):
        seen[a] = threading.get_ident()
        return list(range(a, b))

    with ThreadPoolExecutor(2) as pool:
        results = share_runs(pool, run, even_runs(9, 3))
    assert results == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert seen[0] == threading.get_ident() and len(seen) == 3  # the first run on this thread
    assert {seen[3], seen[6]} != {threading.get_ident()}  # the others on the pool's
    assert share_runs(None, run, [(0, 4)]) == [[0, 1, 2, 3]]
