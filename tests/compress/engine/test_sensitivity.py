"""Sensitivity measured one block at a time, against the whole model run by transformers with the same
weights quantized (round to nearest, so the quantized weights are known independently)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compress.checkpoints.model_io import open_model, quantizable_layers
from compress.engine.sensitivity import Solver, SolverSettings, measure_sensitivity
from compress.formats.candidates import parse_candidates
from compress.formats.gguf.codecs import decode_tensor, encode_tensor
from compress.quantizers.rtn import rtn

RTN = SolverSettings(Solver.rtn)


@pytest.fixture
def calibration():
    return torch.randint(0, 250, (3, 24), generator=torch.Generator().manual_seed(0))


def kld(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def block_outputs(model, tokens) -> list[torch.Tensor]:
    outputs = []
    hooks = [b.register_forward_hook(lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
             for b in model.model.layers]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    return outputs


def relative(changed: torch.Tensor, clean: torch.Tensor) -> float:
    return float(((changed - clean).square().sum(-1) / clean.square().sum(-1)).mean())


def test_residual_errors_and_uniform_klds_match_the_whole_model(tiny_llama, calibration):
    candidates = parse_candidates("w2g32,w4g64")
    handle = open_model(tiny_llama)
    names = [handle.block_name(i) for i in range(len(handle.blocks))]
    layers = quantizable_layers(handle.model, names)
    run = measure_sensitivity(handle, calibration, candidates, layers, RTN, batch_size=2, scale_bytes=4)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        clean_logits = model(calibration).logits
    clean_blocks = block_outputs(model, calibration)
    modules = dict(model.named_modules())
    for name in ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.v_proj"]:
        index = int(name.split(".")[2])
        for c in candidates:
            original = modules[name].weight.detach().clone()
            with torch.no_grad():
                modules[name].weight.copy_(rtn(original, c.scheme).weight)
            changed = block_outputs(model, calibration)[index]
            with torch.no_grad():
                modules[name].weight.copy_(original)
            assert run.layers[name][c.name].residual_error == pytest.approx(relative(changed, clean_blocks[index]), rel=1e-4)
            assert run.layers[name][c.name].bytes == c.stored_bytes(*original.shape, 4)
    for c in candidates:  # every measured layer quantized at once
        originals = {n: modules[n].weight.detach().clone() for n in layers}
        with torch.no_grad():
            for n in layers:
                modules[n].weight.copy_(rtn(originals[n], c.scheme).weight)
            quantized_logits = model(calibration).logits
            for n in layers:
                modules[n].weight.copy_(originals[n])
        assert run.uniform_kld[c.name] == pytest.approx(kld(clean_logits, quantized_logits), rel=1e-4)
    assert run.uniform_kld["w2g32"] > run.uniform_kld["w4g64"] > 0


def test_gguf_candidates_measure_embeddings_and_output_layer(tiny_llama, calibration):
    candidates = parse_candidates("q4_0,q8_0")
    handle = open_model(tiny_llama)
    from compress.run.measure import selected_layers

    layers = selected_layers(handle, True, None, None)
    assert {"model.embed_tokens", "lm_head"} <= set(layers)
    run = measure_sensitivity(handle, calibration, candidates, layers, RTN, batch_size=3)

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def ggml(w: torch.Tensor, kind) -> torch.Tensor:
        return torch.from_numpy(decode_tensor(encode_tensor(w.numpy(), kind), kind, w.shape[1]))

    with torch.no_grad():
        clean = model(calibration).logits
        for c in candidates:
            head = model.lm_head.weight.detach().clone()
            model.lm_head.weight.copy_(ggml(head, c.ggml))
            changed = model(calibration).logits
            model.lm_head.weight.copy_(head)
            assert run.layers["lm_head"][c.name].kld == pytest.approx(kld(clean, changed), rel=1e-4)
            embed = model.model.embed_tokens.weight
            original = embed.detach().clone()
            delta = ggml(original, c.ggml)[calibration] - original[calibration]
            expected = float((delta.square().sum(-1) / original[calibration].square().sum(-1)).mean())
            assert run.layers["model.embed_tokens"][c.name].residual_error == pytest.approx(expected, rel=1e-4)
            embed.copy_(ggml(original, c.ggml))
            changed = model(calibration).logits
            embed.copy_(original)
            assert run.layers["model.embed_tokens"][c.name].kld == pytest.approx(kld(clean, changed), rel=1e-4)
    assert run.uniform_kld["q4_0"] > run.uniform_kld["q8_0"] > 0


def test_gptq_measures_lower_error_than_rounding(tiny_llama, calibration):
    candidates = parse_candidates("w3g32")
    runs = []
    for settings in (SolverSettings(), RTN):
        handle = open_model(tiny_llama)
        layers = quantizable_layers(handle.model, [handle.block_name(0)])
        runs.append(measure_sensitivity(handle, calibration, candidates, layers, settings))
    gptq_run, rtn_run = runs
    for name in layers:
        assert gptq_run.layers[name]["w3g32"].layer_error < rtn_run.layers[name]["w3g32"].layer_error


def test_candidates_stored_alike_are_solved_once_with_the_figures_of_a_run_of_their_own(tiny_llama, calibration, monkeypatch):
    """Rows of 64 weights: q2_k and q3_k both fall back to Q4_0, q6_k to Q8_0. Each layer is solved and replayed
    once per stored type, and every candidate gets the figures a run measuring it alone gives."""
    import compress.engine.sensitivity as sensitivity

    def measure(candidates: str):
        handle = open_model(tiny_llama)
        layers = quantizable_layers(handle.model, [handle.block_name(i) for i in range(len(handle.blocks))])
        return layers, measure_sensitivity(handle, calibration, parse_candidates(candidates), layers, batch_size=3)

    calls = []
    solve = sensitivity.quantize_with
    monkeypatch.setattr(sensitivity, "quantize_with", lambda c, w, *a: calls.append(c.name) or solve(c, w, *a))
    layers, joint = measure("q2_k,q3_k,q8_0,q6_k")
    assert sorted(set(calls)) == ["q2_k", "q8_0"] and len(calls) == 2 * len(layers)
    for name in ("q3_k", "q6_k"):
        _, alone = measure(name)
        for layer in layers:
            assert joint.layers[layer][name] == alone.layers[layer][name]
        assert joint.uniform_kld[name] == pytest.approx(alone.uniform_kld[name], rel=1e-6)


def test_tied_embeddings_are_measured_once_with_both_of_their_effects(tmp_path, calibration):
    """A tied checkpoint stores no lm_head.weight: the embeddings are measured as the one GGUF tensor, their
    KLD the sum of quantizing the output projection alone and the input lookup alone (transformers, untied by hand)."""
    from conftest import save_random_model, tiny_llama_config
    from compress.run.measure import selected_layers

    path = save_random_model(tiny_llama_config(tie_word_embeddings=True), tmp_path / "tied")
    handle = open_model(path)
    layers = selected_layers(handle, True, None, None)
    assert "model.embed_tokens" in layers and "lm_head" not in layers
    candidates = parse_candidates("q4_0")
    run = measure_sensitivity(handle, calibration, candidates, layers, RTN, batch_size=3)
    assert "lm_head" not in run.layers

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    original = model.model.embed_tokens.weight.detach().clone()
    q = torch.from_numpy(decode_tensor(encode_tensor(original.numpy(), candidates[0].ggml), candidates[0].ggml, original.shape[1]))
    with torch.no_grad():
        clean = model(calibration).logits
        model.lm_head.weight = torch.nn.Parameter(q.clone())  # unties: only the output projection quantized
        head_only = kld(clean, model(calibration).logits)
        model.lm_head.weight = torch.nn.Parameter(original.clone())
        model.model.embed_tokens.weight.copy_(q)  # only the input lookup
        embed_only = kld(clean, model(calibration).logits)
    assert run.layers["model.embed_tokens"]["q4_0"].kld == pytest.approx(head_only + embed_only, rel=1e-4)


def test_embedding_sizes_are_those_the_gguf_file_writes(tiny_llama, calibration, tmp_path):
    """The embeddings' rows are tokens ([300, 64]): Q4_K falls back by the 64-wide rows (to Q5_0), as the
    exporter writes them; read as [64, 300] they were sized as rows of 300 (SmolLM2's plans ran 7 % over)."""
    from dataclasses import replace as with_types

    from compress.export.gguf import ExportConfig, export_gguf
    from compress.formats.gguf.plan import Target
    from compress.formats.gguf.sizes import GGMLType
    from compress.run.measure import selected_layers

    gguf = pytest.importorskip("gguf")
    handle = open_model(tiny_llama)
    layers = selected_layers(handle, True, None, None)
    run = measure_sensitivity(handle, calibration, parse_candidates("q4_k,q8_0"), layers, RTN, batch_size=3)
    written = {}
    for name, kind in (("q4_k", GGMLType.Q5_0), ("q8_0", GGMLType.Q8_0)):
        config = ExportConfig(tiny_llama, tmp_path / f"{name}.gguf", Target.q8_0, types={"token_embd.weight": kind})
        tensors = {t.name: t for t in gguf.GGUFReader(export_gguf(config).output).tensors}
        written[name] = (int(tensors["token_embd.weight"].n_bytes), tensors["token_embd.weight"].tensor_type.name.lower())
    assert {c: (m.bytes, m.stored) for c, m in run.layers["model.embed_tokens"].items()} == written


def test_a_checkpoint_without_its_output_side_fails_before_any_block(tiny_llama, calibration, tmp_path):
    """The output layer and final norm are read after every block has run: one missing is a one-line error
    before the first block is measured, not after the last."""
    import shutil

    from safetensors.torch import load_file, save_file

    from compress.errors import CompressError

    broken = tmp_path / "no-head"
    shutil.copytree(tiny_llama, broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    assert "lm_head.weight" in tensors  # untied
    del tensors["lm_head.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    handle = open_model(broken)
    layers = quantizable_layers(handle.model, [handle.block_name(i) for i in range(len(handle.blocks))])
    measured = []
    with pytest.raises(CompressError, match="lm_head.weight"):
        measure_sensitivity(handle, calibration, parse_candidates("w4g64"), layers, RTN, batch_size=2,
                            on_layer=lambda *a, **k: measured.append(a))
    assert measured == []
