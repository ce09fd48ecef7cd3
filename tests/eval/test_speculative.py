"""compress.eval.speculative: acceptance against hand-computed examples, the tokens-per-call formula
against its series, and `compress eval speculative` end to end (timing printed, never asserted)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from compress.cli import app
from compress.eval.speculative import acceptance, expected_tokens_per_call
from conftest import EVAL_TEXT, save_random_model, tiny_llama_config, train_tiny_tokenizer

runner = CliRunner()


def test_acceptance_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    q = torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.7, 0.1]])
    target, draft = p.log(), q.log() + 3.0  # logits: any shift per row is the same distribution
    assert acceptance(target, draft, 0).tolist() == [0.0, 1.0]  # argmax 0 vs 1; 1 vs 1
    # Σ min(p, q): 0.2 + 0.3 + 0.2 = 0.7 and 0.1 + 0.6 + 0.1 = 0.8
    assert acceptance(target, draft, 1.0).tolist() == pytest.approx([0.7, 0.8])
    # T = 0.5 squares the probabilities before renormalising: (0.04 + 0.09 + 0.04) / 0.38 for row 0
    assert float(acceptance(target, draft, 0.5)[0]) == pytest.approx(0.17 / 0.38)
    assert acceptance(target, target, 0.7).tolist() == pytest.approx([1.0, 1.0])


def test_expected_tokens_per_call_is_the_geometric_series():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in range(1, 9):
            assert expected_tokens_per_call(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))
    assert expected_tokens_per_call(0.5, 2) == 1.75
    with pytest.raises(ValueError):
        expected_tokens_per_call(1.5, 2)


ARGS = ["--text", str(EVAL_TEXT), "--max-tokens", "300", "--ctx", "64", "--prompts", "2", "--prompt-tokens", "8",
        "--new-tokens", "6", "--k", "3", "--json"]


def test_a_model_drafting_for_itself_is_always_accepted(tiny_llama, tmp_path):
    for temperature in ("0", "0.7"):
        result = runner.invoke(app, ["eval", "speculative", str(tiny_llama), "--target", str(tiny_llama), *ARGS, "--temperature", temperature])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["alpha_text"] == pytest.approx(1.0) and data["alpha_generated"] == pytest.approx(1.0)
        assert data["positions_text"] == 299 and data["positions_generated"] == 12
        assert data["expected"]["generated"]["3"] == pytest.approx(4.0)
        assert data["timing"]["speedup"] > 0  # measured on this machine: printed, not judged
    assert data["timing"]["same_output"] is None  # only greedy compares outputs


def test_another_draft_and_a_tokenizer_mismatch(tiny_llama, tiny_tokenizer, tmp_path):
    other = save_random_model(tiny_llama_config(len(tiny_tokenizer), num_hidden_layers=1), tmp_path / "d", tiny_tokenizer, seed=9)
    result = runner.invoke(app, ["eval", "speculative", str(other), "--target", str(tiny_llama), *ARGS])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert 0 <= data["alpha_text"] < 1 and data["timing"]["same_output"] is True  # greedy assisted = plain greedy
    a = data["alpha_generated"]
    assert data["expected"]["generated"]["8"] == pytest.approx((1 - a ** 9) / (1 - a))
    small = train_tiny_tokenizer(EVAL_TEXT.read_text(encoding="utf-8")[:20000], vocab_size=280)
    stranger = save_random_model(tiny_llama_config(len(small)), tmp_path / "s", small)
    result = runner.invoke(app, ["eval", "speculative", str(stranger), "--target", str(tiny_llama), *ARGS])
    assert result.exit_code == 2 and "different tokenizers" in result.output
    assert len(result.output.strip().splitlines()) == 1
