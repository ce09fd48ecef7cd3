"""The shipped reference model: its properties, its sensitivity to quantization, and reproducible training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from compress.eval.reference_model import ReferenceModelConfig, default_model_path, train_reference_model
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL

MAX_BYTES = 25 * 2**20


def test_shipped_checkpoint_properties():
    assert default_model_path() == REFERENCE_MODEL
    config = json.loads((REFERENCE_MODEL / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert (REFERENCE_MODEL / "model.safetensors").stat().st_size <= MAX_BYTES
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.in_features % 256 == 0 for m in linears)
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    ids = tokenizer("To be, or not to be", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "To be, or not to be"  # byte-level BPE round trip
    card = (REFERENCE_MODEL / "README.md").read_text()
    assert "test.txt" in card and "milton" in card.lower()


_FIGURES: dict[tuple[int, int], object] = {}  # each run once, shared by the tests of this module


def rtn_figures(tmp_path, bits: int, group: int):
    if (bits, group) not in _FIGURES:
        recipe = parse_recipe({
            "model": REFERENCE_MODEL,
            "stages": [{"method": "rtn", "bits": bits, "group_size": group}],
            "output": {"path": tmp_path / f"w{bits}g{group}"},
            "evaluation": {"text": EVAL_TEXT, "ctx": 512},
        })
        _FIGURES[bits, group] = run_recipe(recipe).evaluation
    return _FIGURES[bits, group]


def test_rtn_8bit_is_nearly_lossless(tmp_path):
    ev = rtn_figures(tmp_path, 8, 128)
    assert ev.kld < 0.002
    assert abs(ev.perplexity / ev.ref_perplexity - 1) < 0.005


def test_rtn_3bit_visibly_hurts_the_reference_model(tmp_path):
    """A model this sensitive makes every quality comparison in the test suite meaningful."""
    w8, w3 = rtn_figures(tmp_path, 8, 128), rtn_figures(tmp_path, 3, 128)
    assert w3.kld > 0.02 and w3.kld > 20 * w8.kld
    assert w3.perplexity > 1.02 * w3.ref_perplexity


def test_training_is_deterministic(tmp_path):
    cfg = ReferenceModelConfig(
        vocab_size=300, hidden_size=256, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
        seq_len=32, batch_size=2, steps=3, warmup_steps=1,
    )
    a = train_reference_model(CALIB_TEXT, tmp_path / "a", cfg)
    b = train_reference_model(CALIB_TEXT, tmp_path / "b", cfg)
    assert a["final_loss"] == b["final_loss"]
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_config_rejects_widths_that_break_group_sizes():
    with pytest.raises(ValueError, match="multiple of 256"):
        ReferenceModelConfig(hidden_size=320)
