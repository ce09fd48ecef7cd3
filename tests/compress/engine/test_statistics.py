"""Tests for compress.engine.statistics: input statistics checked against direct float64 computations."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from compress.engine.statistics import GramScratch, InputStatistics, InputsDiverged, Stat, StatsCollector, layer_in_features

ALL = frozenset(Stat) - {Stat.INPUT_DRIFT}  # the statistics of the input alone; INPUT_DRIFT's tests are below


def _data(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    # uneven channel scales, a few outliers and negative offsets: per-channel stats must differ
    x = x * torch.linspace(0.1, 3.0, shape[-1]) - 0.3
    return x.to(dtype)


def reference_stats(xs: list[torch.Tensor], in_features: int) -> dict[Stat, np.ndarray]:
    """Direct float64 statistics over all token vectors of all batches."""
    X = np.concatenate([x.detach().double().numpy().reshape(-1, in_features) for x in xs], axis=0)
    n = X.shape[0]
    return {
        Stat.HESSIAN: 2.0 / n * (X.T @ X),
        Stat.INPUT_L2: np.sqrt((X**2).sum(axis=0)),
        Stat.INPUT_ABSMAX: np.abs(X).max(axis=0),
        Stat.INPUT_ABSMEAN: np.abs(X).mean(axis=0),
    }


def assert_matches(got: dict[Stat, torch.Tensor], ref: dict[Stat, np.ndarray], needs, rtol=1e-5):
    assert set(got) == set(needs)
    for k in needs:
        g = got[k]
        assert g.dtype == torch.float32
        assert g.shape == ref[k].shape, (k, g.shape, ref[k].shape)
        scale = np.abs(ref[k]).max()
        np.testing.assert_allclose(g.numpy(), ref[k], rtol=rtol, atol=rtol * scale, err_msg=str(k))


@pytest.mark.parametrize(
    "shapes",
    [
        [(40, 16)],  # one 2-D batch
        [(2, 9, 16)],  # one 3-D batch
        [(3, 16), (17, 16), (1, 16)],  # several 2-D batches
        [(2, 5, 16), (1, 7, 16), (4, 3, 16)],  # several 3-D batches of different lengths
        [(2, 5, 16), (11, 16)],  # mixed
    ],
    ids=["2d", "3d", "2d-multi", "3d-multi", "mixed"],
)
def test_all_stats_match_direct_computation(shapes):
    xs = [_data(s, seed=i) for i, s in enumerate(shapes)]
    st = InputStatistics(16, ALL)
    for x in xs:
        st.update(x)
    assert st.count == sum(int(np.prod(s[:-1])) for s in shapes)
    ref = reference_stats(xs, 16)
    assert_matches(st.result(), ref, ALL)


def test_hessian_is_symmetric_psd():
    x = _data((64, 12), seed=3)
    st = InputStatistics(12, frozenset({Stat.HESSIAN}))
    st.update(x[:10])
    st.update(x[10:])
    h = st.result()[Stat.HESSIAN].double()
    torch.testing.assert_close(h, h.T, rtol=1e-6, atol=1e-6)
    assert torch.linalg.eigvalsh(h).min() > -1e-4


def test_batching_invariance():
    x = _data((4, 30, 24), seed=7)
    flat = x.reshape(-1, 24)
    splittings = {
        "whole": [x],
        "per-sample": list(x.unbind(0)),
        "uneven-rows": [flat[:1], flat[1:50], flat[50:51], flat[51:]],
        "one-token-at-a-time": [flat[i : i + 1] for i in range(flat.shape[0])],
    }
    results = {}
    for name, parts in splittings.items():
        st = InputStatistics(24, ALL)
        for p in parts:
            st.update(p)
        assert st.count == 120
        results[name] = st.result()
    base = results.pop("whole")
    for name, res in results.items():
        for k in ALL:
            torch.testing.assert_close(res[k], base[k], rtol=1e-5, atol=1e-5 * float(base[k].abs().max()), msg=f"{name} {k}")
    assert_matches(base, reference_stats([x], 24), ALL)


@pytest.mark.parametrize(
    "needs",
    [frozenset(c) for r in range(0, len(ALL) + 1) for c in itertools.combinations(sorted(ALL, key=lambda s: s.value), r)],
    ids=lambda n: "+".join(sorted(s.value for s in n)) or "none",
)
def test_only_requested_stats(needs):
    st = InputStatistics(8, needs)
    assert (st.outer_sum is not None) == (Stat.HESSIAN in needs)
    assert (st.sq_sum is not None) == (Stat.INPUT_L2 in needs)
    assert (st.absmax is not None) == (Stat.INPUT_ABSMAX in needs)
    assert (st.abs_sum is not None) == (Stat.INPUT_ABSMEAN in needs)
    x = _data((3, 4, 8), seed=1)
    st.update(x)
    res = st.result()
    assert set(res) == set(needs)
    assert_matches(res, reference_stats([x], 8), needs)


def test_input_l2_absmax_absmean_by_hand():
    x = torch.tensor([[3.0, -1.0, 0.0], [-4.0, 2.0, 0.0]])
    st = InputStatistics(3, ALL)
    st.update(x)
    r = st.result()
    torch.testing.assert_close(r[Stat.INPUT_L2], torch.tensor([5.0, 5.0**0.5, 0.0]))
    torch.testing.assert_close(r[Stat.INPUT_ABSMAX], torch.tensor([4.0, 2.0, 0.0]))
    torch.testing.assert_close(r[Stat.INPUT_ABSMEAN], torch.tensor([3.5, 1.5, 0.0]))
    # H = 2/n X^T X with n = 2
    torch.testing.assert_close(r[Stat.HESSIAN], (x.T @ x) * (2.0 / 2))


def test_absmax_of_all_negative_inputs():
    x = -(_data((10, 6), seed=2).abs() + 0.5)
    st = InputStatistics(6, frozenset({Stat.INPUT_ABSMAX}))
    st.update(x)
    np.testing.assert_allclose(st.result()[Stat.INPUT_ABSMAX].numpy(), np.abs(x.double().numpy()).max(0), rtol=0)


def test_empty_batch_is_ignored():
    x = _data((6, 8), seed=4)
    st = InputStatistics(8, ALL)
    st.update(torch.empty(0, 8))
    st.update(x)
    st.update(torch.empty(2, 0, 8))
    assert st.count == 6
    assert_matches(st.result(), reference_stats([x], 8), ALL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_accumulate_in_float32(dtype):
    x = _data((2, 10, 8), seed=5, dtype=dtype)
    st = InputStatistics(8, ALL)
    st.update(x)
    assert_matches(st.result(), reference_stats([x.float()], 8), ALL)


def test_half_precision_inputs_through_one_scratch_change_no_bit():
    """Two layers' statistics sharing a scratch (`StatsCollector`'s), fed bfloat16 inputs of several sizes in turn
    (its float32 copy reused, grown, then read in part) and a non-contiguous one, sum exactly what each layer's own
    statistics sum from ``.float()`` copies of the same inputs."""
    wide = [_data(s, seed=i, dtype=torch.bfloat16) for i, s in enumerate([(2, 16, 24), (3, 16, 24), (1, 16, 24)])]
    narrow = [_data(s, seed=9 + i, dtype=torch.bfloat16) for i, s in enumerate([(4, 16, 8), (2, 8, 8)])]
    narrow.append(_data((2, 8, 16), seed=20, dtype=torch.bfloat16).transpose(1, 2))  # [2, 16, 8], not contiguous
    scratch = GramScratch()
    shared = InputStatistics(24, ALL, scratch=scratch), InputStatistics(8, ALL, scratch=scratch)
    own = InputStatistics(24, ALL), InputStatistics(8, ALL)
    for a, b in itertools.zip_longest(wide, narrow):
        for x, st, ref in ((a, shared[0], own[0]), (b, shared[1], own[1])):
            if x is not None:
                st.update(x)
                ref.update(x.float())
    for st, ref, xs, width in zip(shared, own, (wide, narrow), (24, 8)):
        got, expected = st.result(), ref.result()
        for k in ALL:
            assert torch.equal(got[k], expected[k]), k
        assert_matches(got, reference_stats([x.float() for x in xs], width), ALL)


def test_scratch_copies_half_precision_into_one_buffer():
    scratch = GramScratch()
    x = torch.randn(3, 5, 7).bfloat16()
    first = scratch.float32_of(x)
    assert first.dtype == torch.float32 and torch.equal(first, x.float())
    second = scratch.float32_of(x[:2])
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, x[:2].float())
    y = torch.randn(4, 4)
    assert scratch.float32_of(y) is y  # float32 as it is


def test_no_data_gives_zeros():
    st = InputStatistics(4, ALL)
    res = st.result()
    assert st.count == 0
    for k in ALL:
        assert torch.count_nonzero(res[k]) == 0


def test_layer_in_features():
    assert layer_in_features(nn.Linear(12, 5)) == 12
    assert layer_in_features(Conv1D(5, 12)) == 12  # Conv1D(nf=out, nx=in), weight [in, out]
    assert layer_in_features(Conv1D(12, 5)) == 5


def _make_layer(kind: str, in_f: int, out_f: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(in_f, out_f) if kind == "linear" else Conv1D(out_f, in_f)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_collector_collects_inside_with_only(kind):
    layer = _make_layer(kind, 16, 6)
    other = nn.Linear(6, 3)
    before = _data((2, 4, 16), seed=10)
    inside = [_data((2, 4, 16), seed=11), _data((5, 16), seed=12)]
    after = _data((3, 16), seed=13)

    collector = StatsCollector({"layer": layer, "other": other}, ALL)
    assert collector.stats["layer"].in_features == 16
    assert collector.stats["other"].in_features == 6
    layer(before)  # not collected: not yet entered
    with torch.no_grad():
        expected_out = [layer(x) for x in inside]
    with collector as c:
        assert c is collector
        assert len(layer._forward_pre_hooks) == 1 and len(other._forward_pre_hooks) == 1
        with torch.no_grad():
            outs = [layer(x) for x in inside]
            mid = [other(o) for o in outs]
    for o, e in zip(outs, expected_out):
        torch.testing.assert_close(o, e, rtol=0, atol=0)  # the hook does not change outputs
    # hooks are removed on exit and nothing more is collected
    assert len(layer._forward_pre_hooks) == 0 and len(other._forward_pre_hooks) == 0
    layer(after)
    other(layer(after))

    res = collector.results()
    assert set(res) == {"layer", "other"}
    assert collector.stats["layer"].count == 8 + 5
    assert_matches(res["layer"], reference_stats(inside, 16), ALL)
    assert_matches(res["other"], reference_stats(outs, 6), ALL)
    del mid


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_collector_removes_hooks_on_exception(kind):
    layer = _make_layer(kind, 8, 4)
    collector = StatsCollector({"l": layer}, frozenset({Stat.HESSIAN}))
    with pytest.raises(RuntimeError, match="boom"):
        with collector:
            layer(_data((3, 8), seed=0))
            raise RuntimeError("boom")
    assert len(layer._forward_pre_hooks) == 0
    assert collector.stats["l"].count == 3


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_collector_with_empty_needs_attaches_nothing(kind):
    layer = _make_layer(kind, 8, 4)
    collector = StatsCollector({"l": layer}, frozenset())
    with collector:
        assert len(layer._forward_pre_hooks) == 0
        layer(_data((3, 8), seed=0))
    assert collector.stats["l"].count == 0
    assert collector.results() == {"l": {}}


def test_collector_subset_of_needs():
    layer = nn.Linear(8, 4)
    needs = frozenset({Stat.INPUT_ABSMEAN, Stat.INPUT_L2})
    xs = [_data((2, 3, 8), seed=s) for s in range(3)]
    with StatsCollector({"l": layer}, needs) as c:
        for x in xs:
            layer(x)
    st = c.stats["l"]
    assert st.outer_sum is None and st.absmax is None
    assert_matches(c.results()["l"], reference_stats(xs, 8), needs)


def test_batching_and_sharing_change_no_bit():
    """Windows batched 8, 3+5 or 1 at a time, or split between two collectors whose sums are added (what
    two processes' all-reduce does), give bit-identical statistics: GPTQ's column order follows the
    Hessian's diagonal, so a last-bit difference there changes many codes."""
    windows = _data((8, 16, 24), seed=3) * torch.logspace(-3, 3, 24)  # widely spread magnitudes
    results = []
    for batches in ([windows], [windows[:3], windows[3:]], list(windows.split(1))):
        st = InputStatistics(24, ALL)
        for b in batches:
            st.update(b)
        results.append(st.result())
    first, second = InputStatistics(24, ALL), InputStatistics(24, ALL)
    first.update(windows[:5])
    second.update(windows[5:])
    first.outer_sum += second.outer_sum
    first.sq_sum += second.sq_sum
    first.abs_sum += second.abs_sum
    torch.maximum(first.absmax, second.absmax, out=first.absmax)
    first.count += second.count
    results.append(first.result())
    for other in results[1:]:
        for k in ALL:
            assert torch.equal(other[k], results[0][k]), k
    assert_matches(results[0], reference_stats([windows], 24), ALL)


def test_routed_tokens_in_any_grouping_change_no_bit():
    """2-D inputs (an MoE expert's tokens, gathered from several windows): the same tokens in other groupings
    give bit-identical statistics."""
    tokens = _data((300, 24), seed=4) * torch.logspace(-3, 3, 24)
    results = []
    for cuts in ([300], [100, 200], [7, 93, 150, 50]):
        st = InputStatistics(24, ALL)
        for part in tokens.split(cuts):
            st.update(part)
        results.append(st.result())
    for other in results[1:]:
        for k in ALL:
            assert torch.equal(other[k], results[0][k]), k
    assert_matches(results[0], reference_stats([tokens], 24), ALL)


# -- layers fed the very same tensor (q/k/v, gate/up) -----------------------------------------------------
def _three_layers():
    torch.manual_seed(1)
    return {"a": nn.Linear(16, 4), "b": nn.Linear(16, 5), "c": nn.Linear(16, 3)}


def test_layers_fed_the_same_tensor_share_one_collection():
    """Each input of a shared set is added once; every layer's figures are still the direct computation
    over its own inputs, and the set's layers get one dict (what tells a method it may solve them stacked)."""
    layers = _three_layers()
    xs = [_data((2, 4, 16), seed=s) for s in range(3)]
    with StatsCollector(layers, ALL, same_input=[["a", "b"]]) as collector, torch.no_grad():
        for x in xs:
            for layer in layers.values():
                layer(x)
    assert collector.stats["a"] is collector.stats["b"] and collector.stats["c"] is not collector.stats["a"]
    assert collector.stats["a"].count == 2 * 4 * 3  # each token once
    results = collector.results()
    for name in layers:
        assert_matches(results[name], reference_stats(xs, 16), ALL)
    assert results["a"] is results["b"] and results["c"] is not results["a"]
    # the float64 sums are gone once the results are out (they would be held while the group is solved)
    assert all(s.outer_sum is None and s.drift_sum is None for s in collector.stats.values())
    assert collector.stats["a"].count == 2 * 4 * 3


def _feed_equal_copy(layers, x):
    layers["a"](x), layers["b"](x.clone())  # equal values, another tensor: not provably the same input


def _skip_follower(layers, x):
    layers["a"](x)


def _follower_twice(layers, x):
    layers["a"](x), layers["b"](x), layers["b"](x)


def _follower_first(layers, x):
    layers["b"](x), layers["a"](x)


@pytest.mark.parametrize("feed", [_feed_equal_copy, _skip_follower, _follower_twice, _follower_first])
def test_a_shared_set_fed_otherwise_raises(feed):
    """Sharing is only right while every follower is fed the leader's very tensor once per leader input."""
    layers = _three_layers()
    with pytest.raises(InputsDiverged):
        with StatsCollector(layers, ALL, same_input=[["a", "b"]]), torch.no_grad():
            first = _data((2, 16), seed=0)
            layers["a"](first), layers["b"](first)  # shared as expected ...
            feed(layers, _data((2, 16), seed=1))  # ... then not
    assert all(not layer._forward_pre_hooks for layer in layers.values())


# -- INPUT_DRIFT: the input's drift from the uncompressed model's input of the same tokens ----------------------
def reference_drift(xs: list[torch.Tensor], refs: list[torch.Tensor], in_features: int) -> np.ndarray:
    """2/n Σ (x_f − x) xᵀ in float64 over all token vectors."""
    X = np.concatenate([x.double().numpy().reshape(-1, in_features) for x in xs])
    F = np.concatenate([f.double().numpy().reshape(-1, in_features) for f in refs])
    return 2.0 / X.shape[0] * (F - X).T @ X


@pytest.mark.parametrize("shapes", [[(2, 9, 16), (1, 5, 16)], [(40, 16), (3, 16)]], ids=["3d", "2d"])
def test_drift_matches_direct_computation(shapes):
    xs = [_data(s, seed=i) for i, s in enumerate(shapes)]
    refs = [x + 0.1 * _data(x.shape, seed=10 + i) for i, x in enumerate(xs)]
    st = InputStatistics(16, frozenset({Stat.HESSIAN, Stat.INPUT_DRIFT}))
    for x, ref in zip(xs, refs):
        st.update(x, ref)
    got = st.result()
    assert_matches(got, {**reference_stats(xs, 16), Stat.INPUT_DRIFT: reference_drift(xs, refs, 16)}, {Stat.HESSIAN, Stat.INPUT_DRIFT})
    assert not torch.allclose(got[Stat.INPUT_DRIFT], got[Stat.INPUT_DRIFT].T)  # not symmetric: (x_f − x) xᵀ


def test_drift_of_an_unchanged_input_is_zero_and_batching_changes_no_bit():
    x = _data((4, 30, 24), seed=7)
    ref = x + 0.05 * _data(x.shape, seed=8)
    same = InputStatistics(24, frozenset({Stat.INPUT_DRIFT}))
    same.update(x, x.clone())
    assert torch.count_nonzero(same.result()[Stat.INPUT_DRIFT]) == 0
    results = []
    for parts in ([slice(0, 4)], [slice(0, 1), slice(1, 3), slice(3, 4)]):
        st = InputStatistics(24, frozenset({Stat.INPUT_DRIFT}))
        for p in parts:
            st.update(x[p], ref[p])
        results.append(st.result()[Stat.INPUT_DRIFT])
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("reference", [None, (3, 5, 8)], ids=["none", "other-shape"])
def test_drift_needs_the_reference_of_the_same_tokens(reference):
    st = InputStatistics(8, frozenset({Stat.INPUT_DRIFT}))
    with pytest.raises(ValueError, match="uncompressed model's input"):
        st.update(_data((2, 5, 8), seed=1), None if reference is None else _data(reference, seed=2))


def test_collector_pairs_each_layer_with_its_reference():
    """Two layers, one fed the other's output: each accumulates its own drift from the reference the
    provider gives for its name; a pair fed one tensor (shared statistics) takes the leader's."""
    torch.manual_seed(0)
    first, second, twin = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)
    layers = {"first": first, "second": second, "twin": twin}
    xs = [_data((2, 5, 16), seed=i) for i in range(3)]
    refs: dict[str, list[torch.Tensor]] = {"first": [], "second": [], "twin": []}
    inputs: dict[str, list[torch.Tensor]] = {"first": [], "second": []}
    current = {}

    def reference(name):
        return current[name]

    with StatsCollector(layers, frozenset({Stat.INPUT_DRIFT}), same_input=[["second", "twin"]], reference=reference) as collector, torch.no_grad():
        for i, x in enumerate(xs):
            current["first"] = x + 0.1 * _data(x.shape, seed=20 + i)
            y = first(x)
            current["second"] = current["twin"] = y + 0.1 * _data(y.shape, seed=30 + i)
            second(y), twin(y)
            inputs["first"].append(x), inputs["second"].append(y)
            refs["first"].append(current["first"]), refs["second"].append(current["second"])
    results = collector.results()
    for name in ("first", "second"):
        np.testing.assert_allclose(results[name][Stat.INPUT_DRIFT].numpy(), reference_drift(inputs[name], refs[name], layer_in_features(layers[name])),
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(results["twin"][Stat.INPUT_DRIFT], results["second"][Stat.INPUT_DRIFT])


@pytest.mark.parametrize("width", [7, 511, 512, 1000, 2049])
def test_upper_gram_is_the_full_product(width):
    """The block-upper Gram accumulation mirrored: xᵀx of a float64 reference, exactly symmetric."""
    from compress.engine.statistics import add_upper_gram_, symmetric_from_upper

    x = torch.randn(48, width, generator=torch.Generator().manual_seed(width))
    total = torch.zeros(width, width, dtype=torch.float64)
    add_upper_gram_(total, x)
    add_upper_gram_(total, 2 * x)
    gram = symmetric_from_upper(total)
    expected = 5 * (x.double().t() @ x.double())
    torch.testing.assert_close(gram, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(gram, gram.t())


@pytest.mark.parametrize("width", [1, 7, 255, 256, 257, 600, 1030])
def test_symmetric_from_upper_mirrors_the_rounded_upper_triangle(width):
    """Each entry on and above the diagonal scaled in float64 and rounded to float32 once, mirrored bit for bit (the
    textbook construction on whole matrices); nothing below ``total``'s diagonal is read (it holds NaN here)."""
    from compress.engine.statistics import symmetric_from_upper

    total = torch.randn(width, width, dtype=torch.float64, generator=torch.Generator().manual_seed(width)) * 1e3
    total = total.triu() + torch.full_like(total, float("nan")).tril(-1)
    upper = (total.nan_to_num().triu() * (2.0 / 3)).float()
    expected = upper + upper.triu(1).t()
    assert torch.equal(symmetric_from_upper(total, 2.0 / 3, torch.float32), expected)


@pytest.mark.parametrize("width", [1, 7, 384, 385, 1000, 1536, 2049, 14336])
def test_upper_blocks_cover_the_upper_triangle_once(width):
    """Every entry on or above the diagonal lies in exactly one block (none counted twice, none missed), and every
    block lies within the matrix; what falls below the diagonal is the waste of the leaves' row panels only: half of
    each panel's first square."""
    from compress.engine.statistics import GRAM_PANEL, _upper_blocks

    counts = torch.zeros(width, width, dtype=torch.int8)  # int8: a 14336-wide count is 205 MB, not 822
    for rows, columns in _upper_blocks(0, width):
        assert 0 <= rows.start < rows.stop <= width and 0 <= columns.start < columns.stop <= width
        counts[rows, columns] += 1
    assert torch.equal(counts.triu(), torch.ones(width, width, dtype=torch.int8).triu())
    below = int(counts.tril(-1).sum())
    assert below <= width * GRAM_PANEL // 2  # the panels' first squares tile the diagonal


@pytest.mark.parametrize("width", [7, 600, 1536])
def test_upper_gram_of_stacked_windows_sums_each_windows_product_in_order(width):
    """Windows given stacked ``[windows, tokens, in]`` (the blocks of the total outside, the windows inside) add
    the very sums that one call per window adds, bit for bit: each window's float32 product, in window order
    (what keeps the Hessians independent of how windows are batched); and they are the float64 Σ xᵀx."""
    from compress.engine.statistics import add_upper_gram_, symmetric_from_upper

    windows = torch.randn(5, 64, width, generator=torch.Generator().manual_seed(width)) * torch.rand(width) * 3
    stacked, one_by_one = (torch.zeros(width, width, dtype=torch.float64) for _ in range(2))
    add_upper_gram_(stacked, windows)
    for window in windows:
        add_upper_gram_(one_by_one, window)
    assert torch.equal(stacked.triu(), one_by_one.triu())
    expected = sum(w.double().t() @ w.double() for w in windows)
    torch.testing.assert_close(symmetric_from_upper(stacked), expected, rtol=1e-5, atol=1e-3)
