"""`inspect_model` counts what is stored: tied weights once (transformers' own count of the loaded model)."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from compress.checkpoints.inspection import inspect_model
from conftest import save_random_model, tiny_llama_config


@pytest.mark.parametrize("tied", [True, False])
def test_parameters_count_tied_embeddings_once(tmp_path, tiny_tokenizer, tied):
    out = save_random_model(tiny_llama_config(len(tiny_tokenizer), tie_word_embeddings=tied), tmp_path / "m", tiny_tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert inspect_model(out)["parameters"] == loaded.num_parameters()
