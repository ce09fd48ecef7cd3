"""The engine's reference stream (asymmetric calibration) against whole-model hooks on the original and the
compressed model, and GPTQ's asymmetric target against its symmetric one on the model's outputs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compress.engine.methods.gptq import GPTQ
from compress.engine.methods.rtn import RTN
from compress.engine.statistics import Stat
from conftest import save_random_model, tiny_llama_config
from engine_cases import SequentialRTN, run_engine

VOCAB = 300


def layer_inputs(model, names, calibration) -> dict[str, torch.Tensor]:
    """Every token's input of each layer ``[n, in]`` (float64), from hooks on a whole-model forward pass."""
    seen, modules = {}, dict(model.named_modules())
    handles = [modules[n].register_forward_pre_hook(lambda _m, args, n=n: seen.__setitem__(n, args[0].reshape(-1, args[0].shape[-1]).double()))
               for n in names]
    with torch.no_grad():
        model(input_ids=calibration, use_cache=False)
    for h in handles:
        h.remove()
    return seen


def loadable(model_dir, out_dir):
    for f in model_dir.iterdir():
        if f.suffix == ".json":
            (out_dir / f.name).write_bytes(f.read_bytes())
    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("rounded_embeddings", [False, True])
def test_drift_is_the_original_models_input_minus_the_compressed_models(tmp_path, rounded_embeddings):
    """Δ = 2/n Σ (x_f − x_q) x_qᵀ: x_f from the original model, x_q from the written (all-quantized) model, since under
    true-sequential every layer's statistics see all layers before it quantized and nothing after it. With
    ``outer_weights`` (a GGUF file's rounded embeddings) the compressed model reads those embeddings."""
    model_dir = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=2), tmp_path / "in")
    calibration = torch.randint(0, VOCAB, (4, 20), generator=torch.Generator().manual_seed(2))
    embeddings = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
    outer = {"model.embed_tokens.weight": (embeddings * 8).round() / 8} if rounded_embeddings else None
    seen = {}

    class Recording(SequentialRTN):
        @property
        def needs(self):
            return frozenset({Stat.HESSIAN, Stat.INPUT_DRIFT})

        def transform_layer(self, name, weight, stats):
            seen[name] = stats[Stat.INPUT_DRIFT].clone()
            return super().transform_layer(name, weight, stats)

    run_engine(model_dir, tmp_path / "out", Recording(RTN.Config(bits=2, group_size=32)), calibration, outer_weights=outer)
    names = list(seen)
    original = layer_inputs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), names, calibration)
    model = loadable(model_dir, tmp_path / "out")
    if outer is not None:
        model.model.embed_tokens.weight.data = outer["model.embed_tokens.weight"]
    compressed = layer_inputs(model, names, calibration)
    for name in names:
        x_f, x_q = original[name], compressed[name]
        expected = 2.0 / x_q.shape[0] * (x_f - x_q).t() @ x_q
        torch.testing.assert_close(seen[name].double(), expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()), msg=name)
    # block 0's q/k/v read the embeddings, the same in both models unless rounded; everything after them drifts
    assert (torch.count_nonzero(seen["model.layers.0.self_attn.q_proj"]) > 0) == rounded_embeddings
    assert all(torch.count_nonzero(seen[n]) > 0 for n in names if not n.startswith("model.layers.0.self_attn.") or n.endswith("o_proj"))


def test_asymmetric_gptq_tracks_the_original_outputs_closer(tmp_path):
    """At 2 bits the drift of earlier layers dominates; fitting each layer to the original model's outputs keeps
    the last hidden states nearer the original's than GPTQ's own target does (on held-out tokens)."""
    model_dir = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=3), tmp_path / "in")
    g = torch.Generator().manual_seed(4)
    calibration, held_out = torch.randint(0, VOCAB, (16, 32), generator=g), torch.randint(0, VOCAB, (8, 32), generator=g)
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    errors = {}
    for asymmetric in (False, True):
        out = tmp_path / f"out-{asymmetric}"
        run_engine(model_dir, out, GPTQ(GPTQ.Config(bits=2, group_size=32, asymmetric=asymmetric)), calibration)
        model = loadable(model_dir, out)
        with torch.no_grad():
            hidden = model.model(input_ids=held_out).last_hidden_state
            errors[asymmetric] = float((hidden - original.model(input_ids=held_out).last_hidden_state).square().mean())
    assert errors[True] < 0.9 * errors[False], errors


def test_asymmetric_after_another_stage_on_the_same_layers_is_refused(tmp_path):
    """An earlier stage may rescale a layer (AWQ, SmoothQuant): the same outputs from other inputs, which the drift
    against the checkpoint's layer would misread."""
    from compress.checkpoints.model_io import open_model, quantizable_layers
    from compress.engine.block_engine import Engine, Stage
    from compress.errors import CompressError

    model_dir = save_random_model(tiny_llama_config(VOCAB, num_hidden_layers=1), tmp_path / "in")
    handle = open_model(model_dir)
    layers = quantizable_layers(handle.model, [handle.block_name(0)])
    stages = [Stage(RTN(RTN.Config(bits=4, group_size=32)), layers), Stage(GPTQ(GPTQ.Config(bits=4, group_size=32, asymmetric=True)), layers)]
    with pytest.raises(CompressError, match="asymmetric gptq after rtn"):
        Engine(handle, stages).check(torch.zeros(2, 8, dtype=torch.long))


def test_asymmetric_with_routed_expert_calibration_is_refused(tmp_path, tiny_tokenizer):
    """Routed calibration sends each expert other tokens in the two models: no token-by-token drift."""
    from architectures import save_architecture
    from compress.checkpoints.model_io import open_model, quantizable_layers
    from compress.engine.block_engine import Engine, Stage
    from compress.errors import CompressError

    handle = open_model(save_architecture("qwen2_moe", tmp_path / "moe", tiny_tokenizer))
    layers = quantizable_layers(handle.model, [handle.block_name(0)])
    engine = Engine(handle, [Stage(GPTQ(GPTQ.Config(bits=4, group_size=32, asymmetric=True)), layers)], all_experts=False)
    with pytest.raises(CompressError, match="every expert on every token"):
        engine.check(torch.zeros(2, 8, dtype=torch.long))
