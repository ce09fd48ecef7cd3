"""compressed-tensors float layouts against compressed-tensors itself: its compressors write the same bytes
from the same weights and scales, its decompressors read ours, its preset schemes parse from our config, and
transformers + compressed-tensors loads our checkpoints with our logits."""

from __future__ import annotations

import json

import pytest
import torch

from references import random_weight
from compress.formats import ct_float
from compress.quantizers.activations import ActivationPreset
from compress.quantizers.float_grid import FloatGrid, FloatScheme
from compress.quantizers.rtn import rtn

pytest.importorskip("compressed_tensors")

CASES = {  # name: (our scheme, compressed-tensors weights args, shape)
    "fp8-channel": (FloatScheme(FloatGrid.FP8, -1), {"strategy": "channel"}, (48, 64)),
    "fp8-tensor": (FloatScheme(FloatGrid.FP8, -1, -1), {"strategy": "tensor"}, (48, 64)),
    "fp8-block": (FloatScheme(FloatGrid.FP8, 32, 32), {"strategy": "block", "block_structure": [32, 32]}, (80, 64)),  # 80: a short last block
    "nvfp4": (FloatScheme(FloatGrid.NVFP4, 16), {"strategy": "tensor_group", "group_size": 16, "num_bits": 4,
                                                  "scale_dtype": torch.float8_e4m3fn}, (48, 64)),
    "mxfp4": (FloatScheme(FloatGrid.MXFP4, 32), {"strategy": "group", "group_size": 32, "num_bits": 4, "scale_dtype": torch.uint8}, (48, 64)),
}


def ct_scheme(args: dict, activations: dict | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(**{"num_bits": 8, "type": "float", "symmetric": True, **args})
    inputs = QuantizationArgs(**activations) if activations else None
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def compressor(scheme: FloatScheme, with_activations: bool):
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(ct_float.format_name(scheme, {"bits": 8} if with_activations else None))


def layer(name: str, seed: int = 0):
    scheme, args, shape = CASES[name]
    w = random_weight(shape, seed) * 0.05
    w[1, 3] = 0.8  # an outlier group; and a group of zeros, and values that round to -0
    w[2, :32] = 0.0
    w[4, :8] = -1e-6
    return rtn(w, scheme), args, w


def as_ct_input(quant, stored_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state dict compressed-tensors' compressors take: the float weight and the float scales."""
    state = {"weight": quant.weight.clone(), "weight_scale": stored_scale.float().clone()}
    if quant.scheme.grid is FloatGrid.MXFP4:
        state["weight_scale"] = torch.exp2(stored_scale.float() - 127)
    if quant.scheme.grid is FloatGrid.NVFP4:
        state["weight_global_scale"] = torch.tensor([quant.scheme.global_scale])
    return state


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("name", sorted(CASES))
def test_compressed_tensors_compressor_writes_our_bytes(name):
    """From the same weight and our scales, CT's compressor writes byte for byte our tensors. From our
    dequantized weight it does too, except that CT's FP4 rounding turns an input −0.0 into nibble 0
    (``torch.sign(-0.0)`` is 0) where a small negative weight, rounded, keeps its sign (nibble 8): both zero."""
    quant, args, w = layer(name)
    ours = ct_float.tensors(quant)
    cls = compressor(quant.scheme, with_activations=True)
    for source in (w, quant.weight):
        state = as_ct_input(quant, ours["weight_scale"])
        state["weight"] = source.clone()
        theirs = cls.compress(state, ct_scheme(args))
        assert set(theirs) == set(ours), (sorted(theirs), sorted(ours))
        for key, t in ours.items():
            assert theirs[key].dtype == t.dtype and theirs[key].shape == t.shape, key
            expected = raw(t)
            if source is quant.weight and key == "weight_packed":
                nibbles = ct_float.unpack_fp4(expected)
                expected = ct_float.pack_fp4(torch.where(nibbles == 8, 0, nibbles))
                assert bool((nibbles == 8).any())  # the case is exercised
            assert torch.equal(raw(theirs[key]), expected), key


@pytest.mark.parametrize("name", sorted(CASES))
def test_compressed_tensors_decompressor_reads_our_tensors(name):
    quant, args, _ = layer(name, seed=1)
    ours = ct_float.tensors(quant)
    theirs = compressor(quant.scheme, True).decompress(dict(ours), ct_scheme(args))["weight"].float()
    scheme = quant.scheme
    block = (scheme.block_rows, scheme.group_size) if scheme.block_rows > 1 else None
    mine = ct_float.dequantize_fp8(ours, block) if scheme.grid is FloatGrid.FP8 else ct_float.dequantize_fp4(ours, scheme.grid)
    assert torch.equal(mine, quant.weight)
    # CT 0.20.1 decompresses FP4 through bfloat16 (unpack_fp4_from_uint8's default dtype): the same value rounded once
    expected = mine.bfloat16().float() if scheme.grid is FloatGrid.NVFP4 else mine
    assert torch.equal(theirs, expected)


def test_nibble_order_by_hand():
    codes = torch.tensor([[1, 2, 15, 8]])
    assert ct_float.pack_fp4(codes).tolist() == [[0x21, 0x8F]]
    assert torch.equal(ct_float.unpack_fp4(ct_float.pack_fp4(codes)), codes.to(torch.int32))


PRESETS = {  # CT preset name: (our weight scheme, our activations)
    "FP8_DYNAMIC": (FloatScheme(FloatGrid.FP8, -1), ActivationPreset.FP8_TOKEN),
    "FP8_BLOCK": (FloatScheme(FloatGrid.FP8, 128, 128), ActivationPreset.FP8_GROUP),
    "NVFP4": (FloatScheme(FloatGrid.NVFP4, 16), ActivationPreset.NVFP4),
    "NVFP4A16": (FloatScheme(FloatGrid.NVFP4, 16), None),
    "MXFP4": (FloatScheme(FloatGrid.MXFP4, 32), ActivationPreset.MXFP4),
    "MXFP4A16": (FloatScheme(FloatGrid.MXFP4, 32), None),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_parses_to_compressed_tensors_presets(preset):
    """Field by field: our weights / input_activations entries, through JSON, are CT's preset scheme."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    scheme, acts = PRESETS[preset]
    record = acts.scheme().to_record() if acts else None
    ours = json.loads(json.dumps({"weights": ct_float.weight_args(scheme),
                                  "input_activations": ct_float.activation_args(record) if record else None}))
    # the preset as a checkpoint's config.json holds it: serialized by CT, read back
    expected = {k: QuantizationArgs(**json.loads(json.dumps(v.model_dump(mode="json")))) for k, v in PRESET_SCHEMES[preset].items()}

    def fields(args):  # every field's value, defaults included
        return {name: getattr(args, name) for name in QuantizationArgs.model_fields}

    assert fields(QuantizationArgs(**ours["weights"])) == fields(expected["weights"])
    if acts is None:
        assert "input_activations" not in expected
    else:
        assert fields(QuantizationArgs(**ours["input_activations"])) == fields(expected["input_activations"])
        assert ct_float.activation_scheme(ours["input_activations"]) == acts.scheme()  # and we read it back
    assert ct_float.scheme_from_args("x", ours["weights"]) == scheme


# -- transformers + compressed-tensors load our checkpoints --------------------------------------------
LOADED = {  # the tiny model is 64 wide: FP8 blocks of 32, per-token FP8 activations
    "fp8-dynamic": {"scheme": "fp8-dynamic"},
    "fp8-block": {"scheme": "fp8-block", "group_size": 32, "block_rows": 32, "activations": "fp8-token"},
    "nvfp4a16": {"scheme": "nvfp4a16"},
    "mxfp4a16": {"scheme": "mxfp4a16"},
}


@pytest.mark.parametrize("name", sorted(LOADED))
def test_transformers_loads_our_output_with_our_logits(name, tmp_path, tiny_llama):
    """FP8 (weights and dynamic activations) through CT's default path: our evaluator's logits. FP4 weights
    through CT's dequantizing path, which rounds NVFP4 weights to bfloat16 (see above): our logits with our
    weights rounded the same way."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from compress.checkpoints.loading import load_model
    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe

    out = tmp_path / name
    run_recipe(parse_recipe({"model": tiny_llama, "stages": [{"method": "rtn", **LOADED[name]}], "output": {"path": out}}))
    ours = load_model(out, torch.device("cpu"))
    kwargs = {} if name.startswith("fp8") else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **kwargs).eval()
    if name == "nvfp4a16":
        for layer, module in theirs.named_modules():
            if layer.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
                mine = ours.get_submodule(layer).dequantized_weight()
                assert torch.equal(module.weight, mine.bfloat16().float())
                ours.get_submodule(layer)._dequantize = lambda t, w=mine: w.bfloat16().float()
    tokens = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens).logits).abs().max() <= 1e-3
