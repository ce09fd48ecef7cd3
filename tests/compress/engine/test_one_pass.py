"""True-sequential in the propagation pass (`compress.engine.one_pass`, `passes.run_solving`) against the
pass-by-pass engine and against hand-computed toy blocks."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from compress.checkpoints.model_io import open_model, quantizable_layers
from compress.engine import block_engine
from compress.engine.block_engine import Engine, Stage
from compress.engine.methods.gptq import GPTQ
from compress.engine.one_pass import first_window, one_pass_bytes
from compress.engine.passes import CallsDiverged, run_solving
from conftest import save_random_model, tiny_llama_config
from engine_cases import run_engine

VOCAB = 300
PASS_BY_PASS = {"batch_size": 2, "activation_memory": 1}  # batches of 2 and no room for one pass over all windows


class Toy(nn.Module):
    """x -> b(relu(a(x)) + x): b's input depends on a's weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return self.b(torch.relu(self.a(x)) + x) * scale


class Partial(Toy):
    """b is called only on batches of more than one window."""

    def forward(self, x, scale=1.0):
        h = torch.relu(self.a(x)) + x
        return self.b(h) if x.shape[0] > 1 else h


@pytest.mark.parametrize("chunks", [[slice(0, 3)], [slice(0, 1), slice(1, 3)], [slice(0, 1), slice(1, 2), slice(2, 3)]])
def test_each_group_is_solved_on_the_input_it_is_about_to_get(chunks):
    """In one batch or in chunks taking turns: each group solved once, on every window's input in order."""
    toy, x = Toy(), torch.randn(3, 2, 4)
    groups = [{"a": toy.a}, {"b": toy.b}]
    seen = {}

    def solve(k, inputs):
        name, module = next(iter(groups[k].items()))
        assert name not in seen
        seen[name] = torch.cat(inputs).clone()
        module.weight.data = module.weight.data.round()  # the "compression": whole-number weights

    out = run_solving(toy, [(x[part], (), {"scale": 2.0}) for part in chunks], groups, solve)
    a_w, b_w = toy.a.weight.detach(), toy.b.weight.detach()
    hidden = torch.relu(x @ a_w.t() + toy.a.bias.detach()) + x  # computed by hand with the rounded a
    torch.testing.assert_close(seen["a"], x)
    torch.testing.assert_close(seen["b"], hidden)
    torch.testing.assert_close(out, (hidden @ b_w.t() + toy.b.bias.detach()) * 2.0)
    assert torch.equal(a_w, a_w.round()) and torch.equal(b_w, b_w.round())


def test_without_a_reader_of_the_output_the_chunks_stop_as_the_last_group_is_solved():
    """``through=False`` (the last block): every group is solved on the same inputs as with the output, and then no
    chunk runs the last group (b) at all."""
    x, runs = torch.randn(3, 2, 4), {}
    for through in (True, False):
        toy, calls, seen = Toy(), Counter(), {}
        toy.b.register_forward_hook(lambda *_: calls.update(["b"]))
        groups = [{"a": toy.a}, {"b": toy.b}]

        def solve(k, inputs):
            seen[k] = torch.cat(inputs).clone()
            next(iter(groups[k].values())).weight.data.mul_(0.5)

        out = run_solving(toy, [(x[:1], (), {}), (x[1:], (), {})], groups, solve, through=through)
        runs[through] = (out, dict(calls), seen, toy.b.weight.detach().clone())
    assert runs[True][1] == {"b": 2} and runs[False][1] == {}  # b ran on both chunks, or on neither
    assert runs[False][0] is None and runs[True][0].shape == x.shape
    for k in (0, 1):
        assert torch.equal(runs[True][2][k], runs[False][2][k])
    assert torch.equal(runs[True][3], runs[False][3])


def test_a_layer_fed_another_input_than_its_group_is_refused():
    toy = Toy()
    with pytest.raises(CallsDiverged, match="b"):
        run_solving(toy, [(torch.randn(1, 2, 4), (), {})], [{"a": toy.a, "b": toy.b}], lambda k, x: None)
    with pytest.raises(CallsDiverged, match="never called"):
        run_solving(toy.a, [(torch.randn(1, 2, 4), (), {})], [{"a": toy.a}, {"b": toy.b}], lambda k, x: None)


@pytest.mark.parametrize("first", [1, 2])
def test_a_chunk_that_skips_a_group_is_refused_without_solving_it(first):
    """Chunks of 1 and 2 windows, in either order: the one-window chunk never calls b."""
    toy, x, solved = Partial(), torch.randn(3, 2, 4), []
    parts = [slice(0, first), slice(first, 3)]
    with pytest.raises(CallsDiverged, match="b"):
        run_solving(toy, [(x[part], (), {}) for part in parts], [{"a": toy.a}, {"b": toy.b}],
                    lambda k, xs: solved.append(k))
    assert solved == [0]


def test_a_failing_solve_stops_every_chunk():
    toy, x = Toy(), torch.randn(4, 2, 4)
    threads = threading.active_count()

    def solve(k, xs):
        if k == 1:
            raise ArithmeticError("no")

    with pytest.raises(ArithmeticError):
        run_solving(toy, [(x[i : i + 1], (), {}) for i in range(4)], [{"a": toy.a}, {"b": toy.b}], solve)
    assert threading.active_count() == threads


def test_window_chunks_are_even_in_order_and_bounded(monkeypatch):
    from compress.engine import one_pass

    layers = {"up": nn.Linear(64, 256)}  # widest 256: 16 tokens x 256 x 4 bytes = 16 KiB a window
    monkeypatch.setattr(one_pass, "CHUNK_BYTES", 3 * 16 * 256 * 4)
    assert one_pass.window_chunks(layers, 2, 16, 4) == [slice(0, 2)]
    assert one_pass.window_chunks(layers, 7, 16, 4) == [slice(0, 2), slice(2, 4), slice(4, 7)]
    assert one_pass.window_chunks(layers, 7, 64, 4) == [slice(i, i + 1) for i in range(7)]  # a window each, at least
    monkeypatch.setattr(one_pass, "MAX_CHUNKS", 2)
    assert one_pass.window_chunks(layers, 7, 64, 4) == [slice(0, 3), slice(3, 7)]


def _gptq():
    return GPTQ(GPTQ.Config(bits=3, group_size=32))


def test_one_pass_writes_what_pass_by_pass_writes(tmp_path):
    """GPTQ on a 2-block model: one pass over all windows equals a statistics pass per group plus propagation."""
    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (5, 24), generator=torch.Generator().manual_seed(1))
    run_engine(model_dir, tmp_path / "one", _gptq(), calibration, batch_size=2)
    run_engine(model_dir, tmp_path / "passes", _gptq(), calibration, **PASS_BY_PASS)
    one, passes = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "passes" / "model.safetensors")
    assert one.keys() == passes.keys()
    for name in one:
        torch.testing.assert_close(one[name], passes[name], rtol=1e-5, atol=1e-6, msg=name)


def test_one_pass_in_chunks_writes_what_one_batch_writes(tmp_path, monkeypatch):
    """The windows' forward passes in chunks taking turns (the arguments cut by window): the same tensors."""
    from compress.engine import one_pass

    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (5, 24), generator=torch.Generator().manual_seed(1))
    chunked = []
    monkeypatch.setattr(one_pass, "CHUNK_BYTES", 1)  # a window each
    monkeypatch.setattr(block_engine, "solve_while_propagating", lambda block, chunks, *a, solve=block_engine.solve_while_propagating, **k: (
        chunked.append(len(chunks)), solve(block, chunks, *a, **k))[1])
    run_engine(model_dir, tmp_path / "chunks", _gptq(), calibration, batch_size=8, window_chunks=True)
    monkeypatch.setattr(one_pass, "CHUNK_BYTES", 1 << 30)
    run_engine(model_dir, tmp_path / "one", _gptq(), calibration, batch_size=8, window_chunks=True)
    monkeypatch.setattr(one_pass, "CHUNK_BYTES", 1)
    run_engine(model_dir, tmp_path / "off", _gptq(), calibration, batch_size=8)  # not asked for: one batch
    assert chunked == [5, 5, 1, 1, 1, 1]
    one, chunks = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "chunks" / "model.safetensors")
    assert one.keys() == chunks.keys()
    for name in one:
        torch.testing.assert_close(chunks[name], one[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("chunk_bytes", [15 << 20, 1], ids=["one-chunk", "a-window-a-chunk"])
def test_a_last_stage_rides_the_pass_after_the_stages_before_it(tmp_path, monkeypatch, tiny_tokenizer, chunk_bytes):
    """SmoothQuant then GPTQ W8A8: SmoothQuant's groups ride GPTQ's one pass, each smoothed as its norm is reached
    (over the one pass's chunks of windows); the tensors are those of the run that takes every pass (the recipe's
    `activation_memory` leaves no room for one), where each smoothing gets a statistics pass of its own before the
    GPTQ group its norm feeds."""
    from compress.engine import one_pass

    monkeypatch.setattr(one_pass, "CHUNK_BYTES", chunk_bytes)
    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe
    from conftest import CALIB_TEXT

    model_dir = save_random_model(tiny_llama_config(len(tiny_tokenizer)), tmp_path / "in", tiny_tokenizer)
    passes = []
    monkeypatch.setattr(block_engine, "solve_while_propagating", lambda *a, solve=block_engine.solve_while_propagating, **k: (
        passes.append(1), solve(*a, **k))[1])
    outputs = {}
    for name, memory in [("one", None), ("passes", 1)]:
        calibration = {"path": CALIB_TEXT, "samples": 6, "seq_len": 24, "batch_size": 2, **({"activation_memory": memory} if memory else {})}
        run_recipe(parse_recipe({"model": model_dir, "calibration": calibration, "output": {"path": tmp_path / name},
                                 "stages": [{"method": "smoothquant"}, {"method": "gptq", "scheme": "w8a8-int8"}]}),
                   window_chunks=True)
        outputs[name] = load_file(tmp_path / name / "model.safetensors")
        if name == "one":
            assert len(passes) == 2  # both blocks
    assert len(passes) == 2 and outputs["one"].keys() == outputs["passes"].keys()
    for name, tensor in outputs["one"].items():
        torch.testing.assert_close(tensor, outputs["passes"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_one_pass_runs_each_block_once(tmp_path):
    """Counted by hooks on the model's modules: one window learns the call order, then one pass per block."""
    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (5, 20), generator=torch.Generator().manual_seed(4))
    handle = open_model(model_dir)
    calls, windows = Counter(), Counter()
    for name, module in handle.model.named_modules():
        if name.endswith(("q_proj", "down_proj")):
            def count(_m, args, short=name.split(".", 2)[2]):
                calls.update([short])
                windows.update({short: args[0].shape[0]})
            module.register_forward_pre_hook(count)
    names = [handle.block_name(i) for i in range(len(handle.blocks))]
    (tmp_path / "out").mkdir()
    from compress.checkpoints.shards import ShardedWriter

    writer = ShardedWriter(tmp_path / "out", 1 << 30)
    Engine(handle, [Stage(_gptq(), quantizable_layers(handle.model, names))], batch_size=2).run(writer, calibration)
    writer.close()
    assert calls == {"0.self_attn.q_proj": 2, "0.mlp.down_proj": 2, "1.self_attn.q_proj": 1, "1.mlp.down_proj": 1}
    assert windows == {"0.self_attn.q_proj": 1 + 5, "0.mlp.down_proj": 1 + 5, "1.self_attn.q_proj": 5, "1.mlp.down_proj": 5}


def test_batch_follows_the_memory_the_pass_needs(tmp_path):
    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    handle = open_model(model_dir)
    layers = quantizable_layers(handle.model, [handle.block_name(0)])
    windows = torch.zeros(6, 16, dtype=torch.long)
    # tiny Llama: width 64, widest layer 128, 4 heads: per token 4·64 + 3·128 + 2·4·16 floats
    need = one_pass_bytes(layers, 6, 16, 4, heads=4)
    assert need == 6 * 16 * 4 * (4 * 64 + 3 * 128 + 2 * 4 * 16)
    for memory, batch in [(need, 6), (need - 1, 2)]:
        engine = Engine(handle, [Stage(_gptq(), layers)], batch_size=2, activation_memory=memory)
        assert engine.capture_batch(windows) == batch
    awq_like = Stage(GPTQ(GPTQ.Config(bits=4, true_sequential=False)), layers)  # not true-sequential: pass by pass
    assert Engine(handle, [awq_like], batch_size=2).capture_batch(windows) == 2


def test_first_window_cuts_only_the_batch_dimension():
    cos, sin, h = torch.randn(3, 5, 8), torch.randn(3, 5, 8), torch.randn(3, 5, 16)
    cut = first_window((h, (), {"position_embeddings": (cos, sin), "cache_position": torch.arange(5), "mask": None}), 3)
    assert cut[0].shape == (1, 5, 16) and cut[2]["position_embeddings"][0].shape == (1, 5, 8)
    assert cut[2]["cache_position"].shape == (5,) and cut[2]["mask"] is None


def test_passes_batch_by_batch_take_the_chunk_size_where_asked(tmp_path, monkeypatch):
    """Where the run asks for heap-sized chunks (``window_chunks``, on the CPU), blocks that are not solved in the one
    pass run batches of at most the chunk's windows: the tiny model's widest layer is its MLP (128 wide), so at 24
    tokens of float32 a window's widest output is 24 x 128 x 4 bytes, and a budget of 2.5 of them takes 2 windows a
    batch. GPTQ's statistics do not depend on the batches: the tensors are those of batches of 4."""
    from compress.engine import one_pass

    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (5, 24), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(one_pass, "CHUNK_BYTES", 24 * 128 * 4 * 5 // 2)
    batches = []
    split = torch.Tensor.split
    monkeypatch.setattr(torch.Tensor, "split", lambda t, size, *a, **k: (batches.append(size), split(t, size, *a, **k))[1])
    no_one_pass = {"batch_size": 4, "activation_memory": 1}  # 5 windows: more than a batch, and no room for one pass
    run_engine(model_dir, tmp_path / "chunks", _gptq(), calibration, window_chunks=True, **no_one_pass)
    chunked, batches[:] = list(batches), []
    run_engine(model_dir, tmp_path / "whole", _gptq(), calibration, **no_one_pass)
    assert chunked[:1] == [2] and batches[:1] == [4]  # the capture's batches
    whole, chunks = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "chunks" / "model.safetensors")
    for name in whole:
        torch.testing.assert_close(chunks[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
