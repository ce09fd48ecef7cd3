"""The compiled bfloat16 Gram matrix (compress.quantizers.gram) against float64 products of the same values, and the
statistics that use it against the same reference."""

from __future__ import annotations

import pytest
import torch

from compress.engine.statistics import InputStatistics, Stat, symmetric_from_upper
from compress.quantizers import gram

RUNS = gram.usable(torch.zeros(32, 32, dtype=torch.float64), torch.zeros(1, 2, 32, dtype=torch.bfloat16))
needs_bf16_cpu = pytest.mark.skipif(not RUNS, reason="this CPU has no AVX512-BF16 (or no C compiler): torch's products run")


def _windows(count: int, tokens: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, tokens, width, generator=g)
    x[..., 3] *= 40.0  # an outlier channel, as activations have
    return x.bfloat16()


def _compiled(windows: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    width = windows.shape[-1]
    total = torch.zeros(width, width, dtype=torch.float64) if total is None else total
    assert gram.usable(total, windows)
    gram.add_upper_gram_bf16_(total, windows, torch.empty(gram.packed_shape(windows), dtype=torch.int32))
    return total


def _float32_bound(windows: torch.Tensor) -> torch.Tensor:
    """Each entry's float32 rounding bound for a sum of ``tokens`` exact products, per window, summed over windows:
    tokens * eps * Σ_t |x_ti| |x_tj| (the textbook bound of a recursive sum)."""
    a = windows.double().abs()
    return windows.shape[1] * torch.finfo(torch.float32).eps * torch.einsum("wti,wtj->ij", a, a)


@needs_bf16_cpu
@pytest.mark.parametrize("count,tokens,width", [(1, 1, 32), (2, 7, 64), (3, 512, 96), (2, 33, 576)])
def test_upper_triangle_is_the_float64_product_to_float32_rounding(count, tokens, width):
    x = _windows(count, tokens, width, seed=tokens)
    got = _compiled(x)
    exact = torch.einsum("wti,wtj->ij", x.double(), x.double())
    upper = torch.ones(width, width, dtype=torch.bool).triu()
    assert torch.all((got - exact).abs()[upper] <= _float32_bound(x)[upper])
    # read back as the statistics do: the lower triangle is never read
    assert torch.allclose(symmetric_from_upper(got), exact, rtol=1e-5, atol=1e-3)


@needs_bf16_cpu
def test_each_window_is_summed_alone_and_added_in_order():
    """Stacked windows give the bits of one call per window, and the total adds to what was there (float64)."""
    x = _windows(5, 40, 64, seed=1)
    stacked = _compiled(x)
    one_at_a_time = torch.zeros(64, 64, dtype=torch.float64)
    for window in x:
        _compiled(window.unsqueeze(0).contiguous(), one_at_a_time)
    upper = torch.ones(64, 64, dtype=torch.bool).triu()
    assert torch.equal(stacked[upper], one_at_a_time[upper])


@needs_bf16_cpu
def test_the_sums_do_not_depend_on_the_thread_count():
    x = _windows(3, 64, 256, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _compiled(x)
        torch.set_num_threads(3)
        shared = _compiled(x)
    finally:
        torch.set_num_threads(threads)
    upper = torch.ones(256, 256, dtype=torch.bool).triu()
    assert torch.equal(alone[upper], shared[upper])


def test_usable_only_where_the_compiled_tiles_apply():
    total = torch.zeros(64, 64, dtype=torch.float64)
    x = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    assert not gram.usable(total, x.float())  # float32: torch's product
    assert not gram.usable(torch.zeros(48, 48, dtype=torch.float64), torch.zeros(2, 8, 48, dtype=torch.bfloat16))
    assert not gram.usable(total, x.transpose(1, 2).contiguous().transpose(1, 2))  # not contiguous
    assert not gram.usable(total.float(), x)
    assert not gram.usable(total, torch.zeros(2, 0, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("panels,parts", [(1, 2), (2, 2), (18, 2), (48, 3), (448, 2), (5, 8)])
def test_balanced_panels_cover_every_panel_once_in_even_shares(panels, parts):
    runs = gram.balanced_panels(panels, parts)
    assert runs[0][0] == 0 and runs[-1][1] == panels and len(runs) <= parts
    assert all(a < b for a, b in runs) and all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))
    work = [sum(q + 1 for q in range(a, b)) for a, b in runs]
    if len(runs) == parts:  # no share above the even one by more than its last panel's work
        even = panels * (panels + 1) / 2 / parts
        assert all(w <= even + b for w, (a, b) in zip(work, runs))


@needs_bf16_cpu
@pytest.mark.parametrize("needs", [frozenset({Stat.HESSIAN}), frozenset({Stat.HESSIAN, Stat.INPUT_L2})])
def test_statistics_of_bfloat16_windows_take_the_compiled_gram(needs):
    """The Hessian of bfloat16 windows 64 wide, alone or beside another statistic: 2/n Σ x xᵀ in float64 within
    float32 rounding, and the other statistic as from float32 copies."""
    chunks = [_windows(2, 24, 64, seed=3), _windows(3, 17, 64, seed=4)]
    st = InputStatistics(64, needs)
    for x in chunks:
        st.update(x)
    n = sum(x.shape[0] * x.shape[1] for x in chunks)
    assert st.count == n
    exact = sum(torch.einsum("wti,wtj->ij", x.double(), x.double()) for x in chunks) * (2.0 / n)
    bound = sum(_float32_bound(x) for x in chunks) * (2.0 / n) + exact.abs() * 2 ** -23  # and the final rounding
    result = st.result()
    assert torch.all((result[Stat.HESSIAN].double() - exact).abs() <= bound)
    if Stat.INPUT_L2 in needs:
        l2 = torch.cat([x.reshape(-1, 64).double() for x in chunks]).square().sum(0).sqrt()
        assert torch.allclose(result[Stat.INPUT_L2].double(), l2, rtol=1e-6)
