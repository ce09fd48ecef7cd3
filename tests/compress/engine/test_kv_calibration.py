"""KV-cache calibration on the engine's block runs, against the keys and values transformers' own
DynamicCache holds after a full-model forward pass on the same calibration windows."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, DynamicCache

from compress.checkpoints.model_io import open_model, quantizable_layers
from compress.checkpoints.shards import ShardedWriter
from compress.engine.block_engine import Engine, Stage
from compress.engine.kv_calibration import KVCacheCalibration, KVCacheSpec
from compress.engine.methods.rtn import RTN
from compress.errors import CompressError


def reference_amax(model_dir, calibration: torch.Tensor, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax = None
    with torch.no_grad():
        for ids in calibration.split(batch):
            cache = DynamicCache(config=model.config)
            model(ids, cache=cache, use_cache=True)
            now = [(layer.keys.abs().amax(dim=(0, 2, 3)), layer.values.abs().amax(dim=(0, 2, 3))) for layer in cache.layers]
            amax = now if amax is None else [(torch.maximum(a, c), torch.maximum(b, d)) for (a, b), (c, d) in zip(amax, now)]
    return amax


def run_engine(model_dir, tmp_path, spec, stages_of=lambda handle: [], calibration=None):
    handle = open_model(model_dir)
    observer = KVCacheCalibration(spec)
    engine = Engine(handle, stages_of(handle), batch_size=3, observer=observer)
    writer = ShardedWriter(tmp_path)
    engine.run(writer, calibration)
    writer.close()
    return observer


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_amax_per_head_equals_the_full_models_cache(tiny_llama, tmp_path, strategy):
    calibration = torch.randint(0, 300, (5, 24), generator=torch.Generator().manual_seed(0))
    observer = run_engine(tiny_llama, tmp_path, KVCacheSpec(format="fp8", strategy=strategy), calibration=calibration)
    reference = reference_amax(tiny_llama, calibration, 3)
    assert list(observer.amax) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for (k, v), (rk, rv) in zip(observer.amax.values(), reference):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=0)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=0)
    tensors = observer.tensors(torch.float32)
    k_scale = tensors["model.layers.1.self_attn.k_scale"]
    want = reference[1][0] / 448
    if strategy == "head":
        assert k_scale.shape == (2, 1, 1)
        torch.testing.assert_close(k_scale.reshape(-1), want, rtol=1e-5, atol=0)
    else:
        assert k_scale.shape == (1,)
        torch.testing.assert_close(k_scale, want.max().reshape(1), rtol=1e-5, atol=0)


def test_scales_are_those_of_the_compressed_model(tiny_llama, tmp_path):
    calibration = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(1))

    def rtn2(handle):
        names = [handle.block_name(i) for i in range(len(handle.blocks))]
        return [Stage(RTN(RTN.Config(bits=2, group_size=16)), quantizable_layers(handle.model, names))]

    quantized = tmp_path / "q"
    quantized.mkdir()
    observer = run_engine(tiny_llama, quantized, KVCacheSpec(format="int8"), rtn2, calibration)
    shutil.copy2(tiny_llama / "config.json", quantized / "config.json")  # the 2-bit weights, written dense
    reference = reference_amax(quantized, calibration, 3)
    original = reference_amax(tiny_llama, calibration, 3)
    torch.testing.assert_close(observer.amax["model.layers.1.self_attn"][0], reference[1][0], rtol=1e-5, atol=0)
    assert not torch.allclose(reference[1][0], original[1][0], rtol=1e-3)


def test_bad_settings():
    for fmt in ("q4_0", "int4", "fp16"):
        with pytest.raises(ValidationError):
            KVCacheSpec(format=fmt)
    with pytest.raises(ValidationError):
        KVCacheSpec(format="fp8", strategy="channel")


def test_needs_calibration_data(tiny_llama, tmp_path):
    with pytest.raises(CompressError, match="KV-cache calibration needs calibration data"):
        run_engine(tiny_llama, tmp_path, KVCacheSpec(format="fp8"))
