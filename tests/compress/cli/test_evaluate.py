"""`compress eval ppl --save-reference` / `--reference-cache`: the saved reference stands in for `--reference`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from compress.cli import app
from conftest import CALIB_TEXT, EVAL_TEXT, save_random_model, tiny_llama_config

runner = CliRunner()
COMMON = ("--text", EVAL_TEXT, "--ctx", "64", "--stride", "48", "--max-tokens", "400")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def ppl_json(*args) -> dict:
    result = invoke("eval", "ppl", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, tiny_tokenizer):
    """A second random model with the tiny Llama's tokenizer: far from it, so its KLD is large."""
    return save_random_model(tiny_llama_config(len(tiny_tokenizer)), tmp_path_factory.mktemp("other"), tiny_tokenizer, seed=1)


def test_reference_cache_stands_in_for_the_reference(tiny_llama, other_model, tmp_path):
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    saved = ppl_json(tiny_llama, *COMMON, "--save-reference", tmp_path / "full.safetensors", "--top-k", vocab)
    assert saved["saved_reference"] == str(tmp_path / "full.safetensors") and saved["kld"] is None
    small = ppl_json(tiny_llama, *COMMON, "--save-reference", tmp_path, "--top-k", "4")  # a directory: default name
    full = ppl_json(other_model, *COMMON, "--reference", tiny_llama)
    cached = ppl_json(other_model, *COMMON, "--reference-cache", tmp_path / "full.safetensors")
    approx = ppl_json(other_model, *COMMON, "--reference-cache", small["saved_reference"])
    assert cached["perplexity"] == approx["perplexity"] == pytest.approx(full["perplexity"], rel=1e-9)
    assert cached["ref_perplexity"] == pytest.approx(full["ref_perplexity"], rel=1e-6)
    assert cached["ref_perplexity"] == pytest.approx(saved["perplexity"], rel=1e-6)
    assert cached["kld"] == pytest.approx(full["kld"], rel=1e-5) and full["kld"] > 0.01
    assert 0 < approx["kld"] < full["kld"]  # the top-4 cache: a lower bound
    table = invoke("eval", "ppl", other_model, *COMMON, "--reference-cache", small["saved_reference"])
    assert table.exit_code == 0 and "lower bound" in table.output


def test_mismatched_uses_are_one_line_errors(tiny_llama, tmp_path):
    cache = tmp_path / "ref.safetensors"
    ppl_json(tiny_llama, *COMMON, "--save-reference", cache, "--top-k", "8")
    before = cache.read_bytes()
    text = ("--text", EVAL_TEXT, "--max-tokens", "400")
    cases = {
        "ctx 64, stride 48": ("--ctx", "64", "--stride", "64"),  # other windows
        "other token ids": ("--ctx", "64", "--stride", "48", "--max-tokens", "399"),
        "--reference-cache were both given": ("--ctx", "64", "--stride", "48", "--reference", tiny_llama),
    }
    for message, extra in cases.items():
        result = invoke("eval", "ppl", tiny_llama, *text, *extra, "--reference-cache", cache)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
    other_text = invoke("eval", "ppl", tiny_llama, "--text", CALIB_TEXT, "--ctx", "64", "--stride", "48",
                        "--max-tokens", "400", "--reference-cache", cache)
    assert other_text.exit_code == 2 and "another text" in other_text.output
    clash = invoke("eval", "ppl", tiny_llama, *COMMON, "--save-reference", cache, "--kv-cache", "int8")
    assert clash.exit_code == 2 and "--save-reference" in clash.output
    foreign = tmp_path / "weights.safetensors"
    foreign.write_bytes(b"precious")
    refused = invoke("eval", "ppl", tiny_llama, *COMMON, "--save-reference", foreign)
    assert refused.exit_code == 2 and "not a reference cache" in refused.output
    assert foreign.read_bytes() == b"precious" and cache.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.safetensors", "weights.safetensors"]  # no temporaries
