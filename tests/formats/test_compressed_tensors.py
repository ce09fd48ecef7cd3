"""compressed-tensors output read by the real consumer: transformers + the compressed-tensors package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL
from references import one_line_error, random_weight
from compress.engine import registry
from compress.eval.perplexity import evaluate
from compress.formats import compressed_tensors as ct
from compress.engine.methods.base import LayerOutcome
from compress.engine.methods.rtn import RTN
from compress.quantizers.grid import QuantScheme
from compress.quantizers.rtn import rtn
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe

pytest.importorskip("compressed_tensors")

CASES = {  # name: (bits, symmetric, group_size, full_range)
    "w4-sym-g128": (4, True, 128, False),
    "w4-asym-g128": (4, False, 128, False),
    "w8-sym-channel": (8, True, -1, False),
    "w3-sym-full-range-g64": (3, True, 64, True),  # signed scales: each group's extreme on code -4
}


def quantize(out: Path, fmt: str, bits: int, symmetric: bool, group_size: int, method: str = "rtn", full_range: bool = False) -> Path:
    stage = {"method": method, "bits": bits, "symmetric": symmetric, "group_size": group_size, "full_range": full_range}
    run_recipe(parse_recipe({"model": REFERENCE_MODEL, "stages": [stage], "output": {"path": out, "format": fmt}}))
    return out


def hf_load(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def tokens():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    return torch.tensor(tok(EVAL_TEXT.read_text(encoding="utf-8")[:6000], add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_our_output_like_the_fake_quantized_model(case, tmp_path, tokens):
    bits, symmetric, group_size, full_range = CASES[case]
    packed = quantize(tmp_path / "ct", "compressed-tensors", bits, symmetric, group_size, full_range=full_range)
    fake = quantize(tmp_path / "fake", "fake", bits, symmetric, group_size, full_range=full_range)
    qc = json.loads((packed / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"]) == (bits, symmetric)
    assert weights["strategy"] == ("channel" if group_size == -1 else "group")

    from transformers.utils.quantization_config import CompressedTensorsConfig

    # Asymmetric checkpoints need dequantize=True in transformers 5.24 + CT 0.20.1 (llm-compressor#1618):
    # the default path builds an unpacked [out, G] zero point and rejects the packed one.
    kwargs = {} if symmetric else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    consumer, reference = hf_load(packed, **kwargs), hf_load(fake)
    from compress.checkpoints.loading import load_model

    ours = load_model(packed, torch.device("cpu"))
    x = tokens[:256].reshape(2, 128)
    with torch.no_grad():
        ref_logits = reference(x).logits
        assert (consumer(x).logits - ref_logits).abs().max() <= 1e-3
        assert (ours(x).logits - ref_logits).abs().max() <= 1e-3
    ppl = {name: evaluate(m, tokens, ctx=256).perplexity for name, m in (("consumer", consumer), ("fake", reference), ("ours", ours))}
    assert ppl["consumer"] == pytest.approx(ppl["fake"], rel=1e-5)
    assert ppl["ours"] == pytest.approx(ppl["fake"], rel=1e-5)


def test_layer_tensors_shapes_and_independent_decode():
    """Shapes of formats.md §3.2, and the codes decoded by hand from the documented bit order."""
    w = random_weight((40, 96), 5)
    quant = rtn(w, QuantScheme(4, False, 32))
    t = ct.pack_quantized_tensors(quant, torch.bfloat16)
    assert t["weight_packed"].shape == (40, 12) and t["weight_packed"].dtype == torch.int32
    assert t["weight_scale"].shape == (40, 3) and t["weight_scale"].dtype == torch.bfloat16
    assert t["weight_shape"].tolist() == [40, 96] and t["weight_shape"].dtype == torch.int64
    assert t["weight_zero_point"].shape == (5, 3)  # packed along dim 0: ceil(40 * 4 / 32)
    words = t["weight_packed"].to(torch.int64) & 0xFFFFFFFF
    for r, c in ((0, 0), (7, 9), (39, 95)):
        assert int(words[r, c // 8] >> (4 * (c % 8)) & 15) == int(quant.codes[r, c])
    zwords = t["weight_zero_point"].to(torch.int64) & 0xFFFFFFFF
    for r, g in ((0, 0), (13, 2), (39, 1)):
        assert int(zwords[r // 8, g] >> (4 * (r % 8)) & 15) == int(quant.zero[r, g])
    sym = ct.pack_quantized_tensors(rtn(w, QuantScheme(4, True, 32)), torch.float32)
    assert "weight_zero_point" not in sym


def test_compressed_tensors_decompressor_reads_our_tensors():
    """CT's own unpacker gives back our codes (signed, zero point subtracted in the signed domain)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    quant = rtn(random_weight((24, 64), 6), QuantScheme(4, False, 16))
    t = ct.pack_quantized_tensors(quant, torch.float32)
    codes = helpers.unpack_from_int32(t["weight_packed"], 4, torch.Size([24, 64]))
    zp = helpers.unpack_from_int32(t["weight_zero_point"], 4, torch.Size([24, 4]), packed_dim=0)
    assert torch.equal(codes.to(torch.int32) + 8, quant.codes)
    assert torch.equal(zp.to(torch.int32) + 8, quant.zero.to(torch.int32))
    torch.testing.assert_close(ct.dequantize_pack_quantized(t, 4, False), quant.weight, rtol=0, atol=0)


class _W8A8(RTN):
    """A stand-in for SmoothQuant's contract: int8 per-channel weights plus an activation record."""

    static = False

    def transform_layer(self, name, weight, stats):
        outcome = super().transform_layer(name, weight, stats)
        return LayerOutcome(outcome.weight, outcome.info, outcome.quant, torch.tensor(0.05) if self.static else None)

    def record(self):
        granularity = {"bits": 8, "granularity": "tensor" if self.static else "token", "dynamic": not self.static, "symmetric": True}
        return {**super().record(), "activations": granularity}


@pytest.mark.parametrize("static", [False, True])
def test_w8a8_int_quantized_loads_in_transformers_and_ours(static, tmp_path, monkeypatch, tokens):
    cls = type("W8A8Test", (_W8A8,), {"static": static, "name": "w8a8-test"})
    monkeypatch.setitem(registry._METHODS, "w8a8-test", cls)
    packed = quantize(tmp_path / "ct", "compressed-tensors", 8, True, -1, method="w8a8-test")
    qc = json.loads((packed / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == "int-quantized" == group["format"]
    assert group["input_activations"]["strategy"] == ("tensor" if static else "token")
    from safetensors.torch import load_file

    stored = load_file(str(packed / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    assert ("model.layers.0.mlp.up_proj.input_scale" in stored) == static

    from transformers.utils.quantization_config import CompressedTensorsConfig

    from compress.checkpoints.loading import load_model

    fake = hf_load(quantize(tmp_path / "fake", "fake", 8, True, -1))
    dequantized = hf_load(packed, quantization_config=CompressedTensorsConfig(dequantize=True))
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.2.mlp.down_proj"):
        torch.testing.assert_close(dequantized.get_submodule(name).weight, fake.get_submodule(name).weight, rtol=0, atol=0)
    ours = load_model(packed, torch.device("cpu"))
    x = tokens[:128].unsqueeze(0)
    with torch.no_grad():
        a8 = ours(x).logits
        w8 = fake(x).logits
    # Activation quantization is applied: outputs differ from weight-only (the static test scale is arbitrary).
    assert 0 < (a8 - w8).abs().max() and torch.isfinite(a8).all()
    assert static or (a8 - w8).abs().max() < 1.0
    if not static:
        # transformers' default path fake-quantizes activations too, on CT's grid (absmax / 127.5, codes
        # -128..127) where ours is the int8-GEMM grid (absmax / 127, -127..127): the same size of effect,
        # not the same rounding.
        with torch.no_grad():
            theirs = (hf_load(packed)(x).logits - w8).abs().max()
        assert 0.3 < theirs / (a8 - w8).abs().max() < 3


def test_w8a8_needs_int8_per_channel_weights():
    fmt = ct.CompressedTensorsFormat()
    msg = one_line_error(fmt.check_stage, {"method": "sq", "bits": 4, "group_size": 128, "activations": {"bits": 8}})
    assert "bits=8" in msg


def test_mixed_precision_stages_get_one_config_group_each(tmp_path, tiny_llama):
    """Two schemes in one model: each group names its layers; transformers and our loader agree with fake."""
    stages = [
        {"method": "rtn", "bits": 4, "group_size": 32, "exclude": ["mlp"]},
        {"method": "rtn", "bits": 8, "group_size": -1, "include": ["mlp"]},
    ]
    outs = {}
    for fmt in ("compressed-tensors", "fake"):
        recipe = {"model": tiny_llama, "stages": stages, "output": {"path": tmp_path / fmt, "format": fmt}}
        outs[fmt] = run_recipe(parse_recipe(recipe)).output
    qc = json.loads((outs["compressed-tensors"] / "config.json").read_text())["quantization_config"]
    groups = sorted(qc["config_groups"].values(), key=lambda g: g["weights"]["num_bits"])
    assert [g["weights"]["num_bits"] for g in groups] == [4, 8]
    assert all("mlp" not in t for t in groups[0]["targets"]) and all("mlp" in t for t in groups[1]["targets"])
    from compress.checkpoints.loading import load_model

    x = torch.randint(0, 200, (1, 12))
    fake = hf_load(outs["fake"])
    with torch.no_grad():
        ref = fake(x).logits
        assert (hf_load(outs["compressed-tensors"])(x).logits - ref).abs().max() <= 1e-5
        assert (load_model(outs["compressed-tensors"], torch.device("cpu"))(x).logits - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["token", "tensor", "then-gptq"])
def test_smoothquant_output_is_int_quantized_and_matches_the_fake_w8a8_model(name, tmp_path, tiny_llama):
    """SmoothQuant's W8A8: packed int-quantized with its activation settings. Our QuantLinear path and the
    fake output (dense weights + evaluation's activation hooks, written independently) give the same logits;
    with a later GPTQ stage the layers keep SmoothQuant's activation quantization and static scales."""
    from compress.checkpoints.loading import load_model

    stages = {
        "token": [{"method": "smoothquant"}],
        "tensor": [{"method": "smoothquant", "activations": "tensor"}],
        "then-gptq": [
            {"method": "smoothquant", "activations": "tensor", "quantize_weights": False},
            {"method": "gptq", "bits": 8, "group_size": -1},
        ],
    }[name]
    calibration = {"path": CALIB_TEXT, "samples": 4, "seq_len": 32}
    outs = {}
    for fmt in ("compressed-tensors", "fake"):
        recipe = {"model": tiny_llama, "calibration": calibration, "stages": stages, "output": {"path": tmp_path / fmt, "format": fmt}}
        outs[fmt] = run_recipe(parse_recipe(recipe)).output
    qc = json.loads((outs["compressed-tensors"] / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == group["format"] == "int-quantized"
    static = name != "token"
    assert group["input_activations"] == {
        "dynamic": not static, "num_bits": 8, "strategy": "tensor" if static else "token", "symmetric": True, "type": "int"
    }
    from safetensors.torch import load_file

    stored = load_file(str(outs["compressed-tensors"] / "model.safetensors"))
    assert sum(k.endswith(".input_scale") for k in stored) == (14 if static else 0)
    x = torch.randint(0, 200, (2, 16))
    packed, fake = load_model(outs["compressed-tensors"], torch.device("cpu")), load_model(outs["fake"], torch.device("cpu"))
    assert sum(getattr(m, "quantizes_input", False) for m in packed.modules()) == 14
    with torch.no_grad():
        torch.testing.assert_close(packed(x).logits, fake(x).logits, rtol=0, atol=1e-5)
