"""The engine collects the statistics of layers fed the very same tensor once (q/k/v, gate/up, every
expert's gate/up when all experts calibrate): the figures must not change by a bit, and a wrong guess of
which layers share must fall back to separate collection."""

from __future__ import annotations

import pytest
import torch

from compress.checkpoints.model_io import open_model, quantizable_layers
from compress.checkpoints.shards import ShardedWriter
from compress.engine.block_engine import Engine, Stage
from compress.engine.methods.base import LayerOutcome, Method
from compress.engine.passes import CallOrder
from compress.engine.statistics import InputStatistics, Stat
from conftest import save_random_model, tiny_llama_config

VOCAB = 300


class Observe(Method):
    """Records every statistic of every layer, changes nothing; ``sequential`` as given."""

    def __init__(self, sequential: bool):
        super().__init__(Method.Config())  # noqa: the base config: no options
        self._sequential, self.seen = sequential, {}

    @property
    def needs(self):
        return frozenset(Stat)

    @property
    def sequential(self):
        return self._sequential

    def transform_layer(self, name, weight, stats):
        self.seen[name] = stats
        return LayerOutcome(weight)


def _observe(model_dir, out_dir, sequential, monkeypatch, same_input=None) -> tuple[dict, int]:
    """Every layer's statistics and the number of `InputStatistics.update` calls; ``same_input(order)``
    replaces the sets the engine found."""
    updates = []
    original = InputStatistics.update
    monkeypatch.setattr(InputStatistics, "update", lambda self, x, reference=None: (updates.append(1), original(self, x, reference)))
    if same_input is not None:
        found = Engine._forward_order
        monkeypatch.setattr(Engine, "_forward_order",
                            lambda self, *a: (lambda o: CallOrder(o.groups, same_input(o)))(found(self, *a)))
    handle = open_model(model_dir)
    method = Observe(sequential)
    names = [handle.block_name(i) for i in range(len(handle.blocks))]
    out_dir.mkdir()
    writer = ShardedWriter(out_dir, 1 << 30)
    calibration = torch.randint(0, VOCAB, (5, 16), generator=torch.Generator().manual_seed(2))
    Engine(handle, [Stage(method, quantizable_layers(handle.model, names))], batch_size=2).run(writer, calibration)
    writer.close()
    monkeypatch.undo()
    return method.seen, len(updates)


def _assert_same_bits(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        for stat, value in expected[name].items():
            assert torch.equal(got[name][stat], value), (name, stat)


@pytest.mark.parametrize("sequential", [True, False])
def test_shared_collection_changes_no_bit_and_saves_the_work(sequential, tmp_path, monkeypatch):
    model = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=2), tmp_path / "in")
    shared, shared_updates = _observe(model, tmp_path / "a", sequential, monkeypatch)
    separate, separate_updates = _observe(model, tmp_path / "b", sequential, monkeypatch, same_input=lambda o: [])
    _assert_same_bits(shared, separate)
    # 7 layers a block, 3 batches, 2 blocks: separately 42 updates; shared q/k/v and gate/up: 4 a block, 24.
    assert (separate_updates, shared_updates) == (42, 24)


def test_a_wrong_guess_falls_back_to_separate_collection(tmp_path, monkeypatch):
    model = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=2), tmp_path / "in")
    separate, _ = _observe(model, tmp_path / "a", False, monkeypatch, same_input=lambda o: [])

    def q_with_o(order):  # o_proj reads the attention's output, not q_proj's input
        flat = [n for group in order.groups for n in group]
        return [[next(n for n in flat if n.endswith("q_proj")), next(n for n in flat if n.endswith("o_proj"))]]

    wrong, _ = _observe(model, tmp_path / "b", False, monkeypatch, same_input=q_with_o)
    _assert_same_bits(wrong, separate)


def test_all_experts_share_one_collection(tmp_path, tiny_tokenizer, monkeypatch):
    """Qwen2-MoE calibrating every expert on every token: all routed experts' gate and up projections (and
    the shared expert's) read the block's one normed input; routed-token counts stay per expert."""
    from architectures import save_architecture

    model = save_architecture("qwen2_moe", tmp_path / "moe", tiny_tokenizer)
    handle = open_model(model)
    calibration = torch.randint(0, len(tiny_tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    engine = Engine(handle, [])
    inputs = engine.capture_inputs(calibration)
    block, name = handle.blocks[0], handle.block_name(0)
    handle.materialize(block, name, "cpu", torch.float32)
    for module in block.modules():
        if hasattr(module, "calibrate_all_experts"):
            module.calibrate_all_experts = True
    order = engine._forward_order(block, quantizable_layers(handle.model, [name]), inputs[0])
    expert_inputs = [n for n in order.same_input if any("experts.0." in m for m in n)]
    assert len(expert_inputs) == 1
    names = {n.removeprefix(name + ".mlp.") for n in expert_inputs[0]}
    routed = {f"experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")}
    assert routed <= names and names - routed == {"shared_expert.gate_proj", "shared_expert.up_proj"}
