"""Tests for compress.pruners.structured against loops, hand-made tensors and transformers' own models."""

from __future__ import annotations

import math

import pytest
import torch

from compress.pruners.structured import (
    Axis, Geometry, StructuredLayout, StructuredPlan, activation_score, block_influence, geometry_of, make_plan,
    parameter_count, prune_tensor, pruned_config, solve_width, target_geometry, top_indices,
)

G = Geometry(layers=4, heads=8, kv_heads=4, head_dim=2, mlp=32, hidden=16)


def test_targets_fractions_and_sizes():
    after = target_geometry(G, {"heads": 0.5, "mlp": 0.25, "hidden": 12, "layers": 3})
    assert after == Geometry(layers=3, heads=4, kv_heads=2, head_dim=2, mlp=24, hidden=12)
    assert target_geometry(G, {"heads": 6}).kv_heads == 3  # 6 query heads = 3 groups of 2
    assert target_geometry(G, {}) == G


@pytest.mark.parametrize("targets, needle", [
    ({"heads": 5}, "multiple of the 2 query heads"),
    ({"heads": 0.1}, "removes none of 4 KV groups"),
    ({"mlp": 40}, "keeps 40 of 32"),
    ({"layers": 2.5}, "neither a fraction"),
    ({"depth": 0.5}, "unknown axis"),
])
def test_bad_targets(targets, needle):
    with pytest.raises(ValueError, match=needle):
        target_geometry(G, targets)


def test_hidden_per_head_keeps_the_hidden_size_a_multiple_of_the_heads_kept():
    """LlamaConfig's rule: 3 heads of width 3 over a hidden size of 9; keeping 2 heads leaves 9 channels, which
    2 heads do not divide (allowed where the config does not check), and hidden=7 divides by neither."""
    g = Geometry(layers=1, heads=3, kv_heads=3, head_dim=3, mlp=8, hidden=9)
    assert target_geometry(g, {"heads": 2}).heads == 2
    with pytest.raises(ValueError, match="hidden size of 9 is not a multiple of the 2 attention heads kept.*hidden=8"):
        target_geometry(g, {"heads": 2}, hidden_per_head=True)
    with pytest.raises(ValueError, match="hidden size of 7 is not a multiple of the 3 .*hidden=6"):
        target_geometry(g, {"hidden": 7}, hidden_per_head=True)
    assert target_geometry(g, {"heads": 1, "hidden": 6}, hidden_per_head=True).hidden == 6


def test_top_indices_keeps_highest_and_breaks_ties_by_index():
    assert top_indices(torch.tensor([0.1, 0.5, 0.5, 0.0, 0.9]), 3) == (1, 2, 4)
    assert top_indices(torch.tensor([1.0, 1.0, 1.0]), 2) == (0, 1)


def test_activation_score_matches_loops():
    x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(0))
    got = activation_score(x, 4)
    expected = torch.zeros(4, dtype=torch.float64)
    for g in range(4):
        for b in range(3):
            per_position = [math.sqrt(sum(float(x[b, t, c]) ** 2 for c in range(3 * g, 3 * g + 3))) for t in range(5)]
            expected[g] += (sum(per_position) / 5) ** 2
    assert torch.allclose(got.double(), expected, rtol=1e-5)


def test_block_influence_matches_loops():
    a = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    b = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2))
    total, count = block_influence(a, b)
    expected = 0.0
    for i in range(2):
        for t in range(3):
            u, v = a[i, t].double(), b[i, t].double()
            expected += 1 - float(u @ v) / math.sqrt(float(u @ u) * float(v @ v))
    assert count == 6 and total == pytest.approx(expected, rel=1e-5)


def plan_for(kv_groups, mlp, hidden, layers=(0, 2)):
    return StructuredPlan(G, tuple(layers), tuple(kv_groups), tuple(mlp), tuple(hidden))


def test_prune_tensor_takes_whole_kv_groups_and_copies():
    plan = plan_for([(1, 3), (0, 2)], [tuple(range(8))] * 2, tuple(range(0, 16, 2)))
    rows = torch.arange(16.0)[:, None].expand(16, 16).clone()  # q_proj: row r belongs to head r // head_dim
    q = prune_tensor(rows, (Axis.Q_HEADS, Axis.HIDDEN), plan, block=0)
    # groups 1 and 3 of 2 query heads each: heads 2, 3, 6, 7 -> rows 4..7, 12..15
    assert q[:, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15] and q.shape == (8, 8)
    kv = prune_tensor(torch.arange(8.0), (Axis.KV_HEADS,), plan, block=1)  # kv heads 0, 2 -> rows 0, 1, 4, 5
    assert kv.tolist() == [0, 1, 4, 5]
    o = prune_tensor(rows.t().contiguous(), (Axis.HIDDEN, Axis.Q_HEADS), plan, block=0)
    assert o[0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert torch.equal(rows[:, 0], torch.arange(16.0))  # the input is untouched
    norm = prune_tensor(torch.ones(16), (Axis.HIDDEN,), plan, rms_norm=True)
    assert torch.allclose(norm, torch.full((8,), math.sqrt(2)))
    assert torch.equal(prune_tensor(torch.ones(16), (Axis.HIDDEN,), plan, rms_norm=True, rescale_norms=False), torch.ones(8))
    with pytest.raises(ValueError, match="not the mlp width"):
        prune_tensor(torch.ones(8, 16), (Axis.MLP, Axis.HIDDEN), plan, block=0)


def test_make_plan_sums_heads_per_group_and_keeps_blocks_in_order():
    heads = torch.zeros(4, 8)
    heads[:, 0:2] = torch.tensor([0.1, 5.0])  # group 0: one strong head
    heads[:, 2:4] = 1.0  # group 1: sum 2
    heads[:, 4:6] = torch.tensor([1.0, 0.5])  # group 2: sum 1.5
    heads[:, 6:8] = 3.0  # group 3: sum 6
    mlp = torch.arange(32.0).expand(4, 32)
    plan = make_plan(G, target_geometry(G, {"heads": 4, "mlp": 4, "hidden": 2, "layers": 2}), heads, mlp,
                     torch.arange(16.0).flip(0), torch.tensor([0.3, 0.1, 0.2, 0.4]))
    assert plan.layers == (0, 3)
    assert plan.kv_groups == ((0, 3), (0, 3))  # sums 5.1 and 6 beat 2 and 1.5
    assert plan.mlp == ((28, 29, 30, 31),) * 2 and plan.hidden == (0, 1)
    assert plan.after == Geometry(layers=2, heads=4, kv_heads=2, head_dim=2, mlp=4, hidden=2)


LAYOUT = StructuredLayout({}, {}, "o", "down", (), ())


def test_pruned_config_and_geometry():
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 32,
              "hidden_size": 16, "rms_norm_eps": 1e-6, "layer_types": ["a", "b", "c", "d"], "vocab_size": 9}
    assert geometry_of(config, LAYOUT) == G  # head_dim from hidden / heads
    plan = plan_for([(0,), (1,)], [(1, 2)] * 2, tuple(range(4)), layers=(1, 3))
    new = pruned_config(config, LAYOUT, plan)
    assert new == {**config, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
                   "intermediate_size": 2, "hidden_size": 4, "rms_norm_eps": pytest.approx(4e-6), "layer_types": ["b", "d"]}
    assert config["hidden_size"] == 16  # not modified


def test_parameter_count_matches_a_transformers_model_of_the_pruned_shape():
    from transformers import LlamaConfig, LlamaForCausalLM

    def model(g: Geometry):
        return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=g.hidden, intermediate_size=g.mlp, num_hidden_layers=g.layers,
                                            num_attention_heads=g.heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim))

    before = Geometry(layers=3, heads=4, kv_heads=2, head_dim=8, mlp=48, hidden=32)
    tensors = {n: p for n, p in model(before).named_parameters()}
    from compress.checkpoints.architecture import structured_layout

    layout = structured_layout("llama")
    block = {n.split(".", 3)[3]: (tuple(p.shape), layout.block_tensors[n.split(".", 3)[3]]) for n, p in tensors.items() if n.startswith("model.layers.0.")}
    outer = {n: (tuple(p.shape), layout.outer_tensors[n]) for n, p in tensors.items() if not n.startswith("model.layers.")}
    after = Geometry(layers=2, heads=2, kv_heads=1, head_dim=8, mlp=20, hidden=24)
    assert parameter_count(block, outer, before, after) == sum(p.numel() for p in model(after).parameters())
    count = lambda g: parameter_count(block, outer, before, g)  # noqa: E731
    solved = solve_width(before, count, target=count(before) // 2)
    assert count(solved) <= count(before) // 2 and solved.mlp % 8 == 0 and solved.hidden % 8 == 0
    assert count(Geometry(**{**solved.__dict__, "mlp": solved.mlp + 8, "hidden": solved.hidden + 8})) > count(before) // 2
    with pytest.raises(ValueError, match="no mlp/hidden width reaches"):
        solve_width(before, count, target=10)
