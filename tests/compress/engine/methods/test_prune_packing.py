"""SparseGPT's joint sparse + quantized result is written packed, and the zeros survive the round trip."""

from __future__ import annotations

import json

import torch

from compress.checkpoints.loading import load_model
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT


def test_joint_sparsegpt_output_is_packed_and_stays_2_of_4(tmp_path, tiny_llama):
    recipe = {
        "model": tiny_llama,
        "stages": [{"method": "sparsegpt", "pattern": "2:4", "bits": 4, "group_size": 32}],
        "calibration": {"path": CALIB_TEXT, "samples": 4, "seq_len": 64},
        "output": {"path": tmp_path / "out", "format": "compressed-tensors"},
    }
    run_recipe(parse_recipe(recipe))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["compression"]["format"] == "compressed-tensors"
    (group,) = config["quantization_config"]["config_groups"].values()
    assert group["format"] == "pack-quantized" and group["weights"]["num_bits"] == 4
    model = load_model(tmp_path / "out", torch.device("cpu"))
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    assert type(layer).__name__ == "QuantLinear"
    weight = layer.dequantized_weight()
    groups = weight.reshape(weight.shape[0], -1, 4)
    assert ((groups == 0).sum(dim=-1) >= 2).all()
