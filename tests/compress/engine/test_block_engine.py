"""The layer-by-layer engine against independent references: full-model forward hooks and loaders."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig

from compress.checkpoints.shards import ShardedWriter
from compress.engine.block_engine import Engine, Stage
from compress.engine.methods.rtn import RTN
from compress.checkpoints.model_io import ModelHandle, open_model, quantizable_layers
from compress.engine.statistics import Stat
from conftest import save_random_model, tiny_llama_config
from engine_cases import CalibratedRTN, Observe, SequentialRTN, StatsSpy, reference_hessians, run_engine

VOCAB = 300


def gpt2_config():
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)


def opt_config():
    return OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        word_embed_proj_dim=64, bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )


CONFIGS = {"llama": lambda: tiny_llama_config(VOCAB), "gpt2": gpt2_config, "opt": opt_config}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_statistics_match_whole_model_hooks(arch, tmp_path):
    model_dir = save_random_model(CONFIGS[arch](), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (5, 24), generator=torch.Generator().manual_seed(1))
    spy = StatsSpy()
    run_engine(model_dir, tmp_path / "out", spy, calibration)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = reference_hessians(model, list(spy.seen), calibration)
    assert len(spy.seen) > 0
    for name, stats in spy.seen.items():
        torch.testing.assert_close(stats[Stat.HESSIAN].double(), expected[name], rtol=1e-4, atol=1e-5)
        diag = expected[name].diagonal()
        n = 5 * 24
        torch.testing.assert_close(stats[Stat.INPUT_L2].double() ** 2, diag * n / 2, rtol=1e-4, atol=1e-5)


def test_later_blocks_see_outputs_of_compressed_blocks(tmp_path):
    """Block i's statistics come from a model whose blocks < i are already quantized, block i not yet."""
    model_dir = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=3), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (4, 20), generator=torch.Generator().manual_seed(2))
    seen = {}

    class Recording(CalibratedRTN):
        def transform_layer(self, name, weight, stats):
            seen[name] = stats[Stat.HESSIAN].clone()
            return super().transform_layer(name, weight, stats)

    run_engine(model_dir, tmp_path / "out", Recording(RTN.Config(bits=3, group_size=32)), calibration)
    for f in (model_dir).iterdir():
        if f.name.endswith(".json") and f.name != "config.json":
            (tmp_path / "out" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "out" / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    original = load_file(str(model_dir / "model.safetensors"))
    # Restore the original weights of the last block: the state the engine saw when it reached it.
    with torch.no_grad():
        for name, p in quantized.named_parameters():
            if name.startswith("model.layers.2."):
                p.copy_(original[name])
    last = [n for n in seen if n.startswith("model.layers.2.")]
    expected = reference_hessians(quantized, last, calibration)
    for name in last:
        torch.testing.assert_close(seen[name].double(), expected[name], rtol=1e-4, atol=1e-5)
    # ... and it differs from what the unquantized model would give (the propagation matters).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    unquantized = reference_hessians(model, last, calibration)
    assert not torch.allclose(seen[last[0]].double(), unquantized[last[0]], rtol=1e-3)


def independent_fake_quant(w_out_in: torch.Tensor, bits: int, group: int):
    """Textbook symmetric min-max group quantization, loop over groups, float64.

    Returns the dequantized weight, the step size of each element, and a mask of rounding ties
    (w / scale within 1e-4 of a half-integer: the group's negative extreme lands exactly on one, and
    float32 and float64 may round it either way).
    """
    w = w_out_in.double()
    out, step, ties = torch.empty_like(w), torch.empty_like(w), torch.zeros_like(w, dtype=torch.bool)
    levels = 2**bits - 1
    for g in range(0, w.shape[1], group):
        block = w[:, g : g + group]
        scale = block.abs().amax(dim=1, keepdim=True) / (levels / 2)
        scale[scale == 0] = 1
        ratio = block / scale
        q = torch.clamp(torch.round(ratio) + 2 ** (bits - 1), 0, levels)
        out[:, g : g + group] = (q - 2 ** (bits - 1)) * scale
        step[:, g : g + group] = scale
        ties[:, g : g + group] = ((ratio - ratio.floor()) - 0.5).abs() < 1e-4
    return out, step, ties


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_rtn_output_is_fake_quantized_original(arch, tmp_path):
    model_dir = save_random_model(CONFIGS[arch](), tmp_path / "in")
    handle, result = run_engine(model_dir, tmp_path / "out", RTN(RTN.Config(bits=4, group_size=32)))
    original = load_file(str(model_dir / "model.safetensors"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(written) == set(original)
    layer_weights = {f"{r.name}.weight" for r in result.layers}
    assert layer_weights and layer_weights <= set(original)
    for name, tensor in original.items():
        if name in layer_weights:
            conv1d = arch == "gpt2"  # GPT-2's Conv1D stores [in, out]
            w = tensor.t() if conv1d else tensor
            expected, step, ties = independent_fake_quant(w, 4, 32)
            got = (written[name].t() if conv1d else written[name]).double()
            torch.testing.assert_close(got[~ties], expected[~ties], rtol=0, atol=1e-6)
            assert ((got - expected).abs()[ties] <= step[ties] * 1.0001).all()
        else:
            assert torch.equal(written[name], tensor), name


def test_one_block_in_memory_at_a_time(tmp_path, monkeypatch):
    model_dir = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=4), tmp_path / "in")
    live, peak = set(), [0]
    real_materialize, real_release = ModelHandle.materialize, ModelHandle.release

    def materialize(self, module, prefix, device, dtype, only=None):
        if only is None:
            live.add(prefix)
            peak[0] = max(peak[0], len(live))
        return real_materialize(self, module, prefix, device, dtype, only)

    def release(module, only=None):
        live.difference_update({p for p in list(live)})
        return real_release(module, only)

    monkeypatch.setattr(ModelHandle, "materialize", materialize)
    monkeypatch.setattr(ModelHandle, "release", staticmethod(release))
    calibration = torch.randint(0, VOCAB, (2, 16))
    handle, _ = run_engine(model_dir, tmp_path / "out", CalibratedRTN(RTN.Config(bits=4, group_size=32)), calibration)
    assert peak[0] == 1
    assert all(p.device.type == "meta" for p in handle.model.parameters())


def test_sharded_output_loads_in_transformers(tmp_path):
    model_dir = save_random_model(gpt2_config(), tmp_path / "in")  # tied lm_head: stored once
    out = tmp_path / "out"
    run_engine(model_dir, out, RTN(RTN.Config(bits=8, group_size=-1)), shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    (out / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    a = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    b = AutoModelForCausalLM.from_pretrained(out).eval()
    assert b.lm_head.weight.data_ptr() == b.transformer.wte.weight.data_ptr()
    x = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(b(x).logits, a(x).logits, rtol=0, atol=0.05)


def test_methods_needing_data_require_calibration(tmp_path):
    from compress.errors import CompressError

    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    with pytest.raises(CompressError, match="needs calibration data"):
        run_engine(model_dir, tmp_path / "out", CalibratedRTN(RTN.Config(group_size=32)))


def test_include_reaches_lm_head_outside_the_blocks(tmp_path):
    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    handle = open_model(model_dir)
    names = [handle.block_name(i) for i in range(len(handle.blocks))]
    layers = quantizable_layers(handle.model, names, include=["lm_head", r"layers\.0\.mlp\.up_proj"])
    (tmp_path / "out").mkdir()
    writer = ShardedWriter(tmp_path / "out")
    result = Engine(handle, [Stage(RTN(RTN.Config(bits=4, group_size=32)), layers)]).run(writer)
    writer.close()
    assert [r.name for r in result.layers] == ["model.layers.0.mlp.up_proj", "lm_head"]
    original = load_file(str(model_dir / "model.safetensors"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name in ("lm_head.weight", "model.layers.0.mlp.up_proj.weight"):
        expected, step, ties = independent_fake_quant(original[name], 4, 32)
        torch.testing.assert_close(written[name].double()[~ties], expected[~ties], rtol=0, atol=1e-6)
    assert torch.equal(written["model.layers.0.mlp.down_proj.weight"], original["model.layers.0.mlp.down_proj.weight"])


def test_statistics_methods_refuse_layers_outside_blocks(tmp_path):
    from compress.errors import CompressError

    model_dir = save_random_model(tiny_llama_config(VOCAB), tmp_path / "in")
    handle = open_model(model_dir)
    layers = quantizable_layers(handle.model, [], include=["lm_head"])
    with pytest.raises(CompressError, match="exclude lm_head"):
        Engine(handle, [Stage(CalibratedRTN(RTN.Config(group_size=32)), layers)]).check(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    "arch,expected,same_input",
    [
        ("llama", [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]],
         [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]),
        ("gpt2", [["attn.c_attn"], ["attn.c_proj"], ["mlp.c_fc"], ["mlp.c_proj"]], []),
        ("opt", [["q_proj", "k_proj", "v_proj"], ["out_proj"], ["fc1"], ["fc2"]], [["q_proj", "k_proj", "v_proj"]]),
    ],
)
def test_call_order_follows_the_data_flow(arch, expected, same_input, tmp_path):
    model_dir = save_random_model(CONFIGS[arch](), tmp_path / "in")
    handle = open_model(model_dir)
    engine = Engine(handle, [])
    calibration = torch.randint(0, VOCAB, (2, 8))
    inputs = engine.capture_inputs(calibration)
    block = handle.blocks[0]
    handle.materialize(block, handle.block_name(0), "cpu", torch.float32)
    layers = quantizable_layers(handle.model, [handle.block_name(0)])
    order = engine._forward_order(block, layers, inputs[0])
    prefix = handle.block_name(0) + "."
    strip = ("self_attn.", "mlp.") if arch != "gpt2" else ()

    def short(groups):
        out = []
        for group in groups:
            names = [n.removeprefix(prefix) for n in group]
            for p in strip:
                names = [n.removeprefix(p) for n in names]
            out.append(sorted(names))
        return out

    assert short(order.groups) == [sorted(g) for g in expected]
    assert short(order.same_input) == [sorted(g) for g in same_input]


@pytest.mark.parametrize("engine", [{}, {"batch_size": 2, "activation_memory": 1}], ids=["one-pass", "pass-by-pass"])
def test_true_sequential_statistics_see_quantized_earlier_groups(engine, tmp_path):
    """o_proj's Hessian comes from a block whose q/k/v are already quantized (and nothing else)."""
    model_dir = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=1), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))
    seen = {}

    class Recording(SequentialRTN):
        def transform_layer(self, name, weight, stats):
            seen[name] = stats[Stat.HESSIAN].clone()
            return super().transform_layer(name, weight, stats)

    run_engine(model_dir, tmp_path / "out", Recording(RTN.Config(bits=2, group_size=32)), calibration, **engine)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight.copy_(independent_fake_quant(proj.weight, 2, 32)[0].float())
    name = "model.layers.0.self_attn.o_proj"
    expected = reference_hessians(model, [name], calibration)[name]
    torch.testing.assert_close(seen[name].double(), expected, rtol=1e-3, atol=1e-5)
    # q/k/v themselves saw the unquantized block's input.
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    q = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(seen[q].double(), reference_hessians(original, [q], calibration)[q], rtol=1e-4, atol=1e-5)


def test_statistics_passes_stop_after_their_group(tmp_path):
    """True-sequential: the q/k/v pass stops before the attention, the o pass before the MLP, the gate/up pass
    before down_proj; each pass ends as its last layer is called, before that layer computes: down_proj's pass
    runs the whole block but down_proj (counted by hooks on the model's modules: called, and computed)."""
    from collections import Counter

    model_dir = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=1), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (4, 20), generator=torch.Generator().manual_seed(4))
    handle = open_model(model_dir)
    calls, computed = Counter(), Counter()
    for name, module in handle.model.named_modules():
        if name.endswith(("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")):
            module.register_forward_pre_hook(lambda _m, _a, short=name.rsplit(".", 1)[1]: calls.update([short]))
            module.register_forward_hook(lambda _m, _a, _o, short=name.rsplit(".", 1)[1]: computed.update([short]))
    stages = [Stage(SequentialRTN(RTN.Config(bits=4, group_size=32)), quantizable_layers(handle.model, [handle.block_name(0)]))]
    (tmp_path / "out").mkdir()
    writer = ShardedWriter(tmp_path / "out", 1 << 30)
    # pass by pass (no memory for one pass over all windows, see test_one_pass.py)
    Engine(handle, stages, batch_size=2, activation_memory=1).run(writer, calibration)
    writer.close()
    # 2 batches; one sample batch learns the call order; 4 group passes; no propagation after the last block
    assert calls == {"q_proj": 1 + 4 * 2, "v_proj": 1 + 4 * 2, "o_proj": 1 + 3 * 2, "up_proj": 1 + 2 * 2, "down_proj": 1 + 1 * 2}
    # the last layer a pass reads is called, not computed: v_proj in the q/k/v pass, o_proj in its own, ...
    assert computed == {"q_proj": 1 + 4 * 2, "v_proj": 1 + 3 * 2, "o_proj": 1 + 2 * 2, "up_proj": 1 + 1 * 2, "down_proj": 1}
