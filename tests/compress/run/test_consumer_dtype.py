"""Every named scheme's output loads in transformers + compressed-tensors under the dtype its config.json records
(``dtype="auto"``, as a user loads it) and runs a forward pass that agrees with our own evaluator's loading."""

from __future__ import annotations

import json

import pytest
import torch

from compress.checkpoints.loading import load_model
from compress.engine.methods.schemes import SchemeName
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, save_random_model, tiny_llama_config


@pytest.fixture(scope="module")
def float32_llama(tmp_path_factory, tiny_tokenizer):
    """A float32 Llama whose widths every scheme's groups and blocks divide (128 and 256)."""
    config = tiny_llama_config(hidden_size=128, intermediate_size=256, head_dim=32)
    return save_random_model(config, tmp_path_factory.mktemp("float32-llama"), tiny_tokenizer)


@pytest.mark.parametrize("scheme", [s.value for s in SchemeName])
def test_every_scheme_loads_and_runs_under_its_recorded_dtype(scheme, float32_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = {"model": float32_llama, "calibration": {"path": CALIB_TEXT, "samples": 4, "seq_len": 32},
              "stages": [{"method": "rtn", "scheme": scheme}], "output": {"path": tmp_path / "out"}}
    out = run_recipe(parse_recipe(recipe)).output
    recorded = json.loads((out / "config.json").read_text())["dtype"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert str(model.dtype).removeprefix("torch.") == recorded
    ids = torch.arange(1, 33).reshape(1, 32)
    with torch.no_grad():
        theirs = torch.log_softmax(model(ids).logits.float(), -1)
        ours = torch.log_softmax(load_model(out, torch.device("cpu")).eval()(ids).logits.float(), -1)
    assert torch.isfinite(theirs).all()
    # the consumer computes in its dtype, our evaluator in float32: the same model within bfloat16's rounding. Int8
    # activations differ more: compressed-tensors' forward and our simulation of them are not the same computation
    # (mean |difference| 0.0023 here), which the W8A8 agreement with the serving engine has yet to settle
    tolerance = 0.05 if recorded == "bfloat16" else 5e-3 if scheme == SchemeName.W8A8_INT8.value else 1e-3
    assert (theirs - ours).abs().mean() < tolerance, (theirs - ours).abs().mean()
