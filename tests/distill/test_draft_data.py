"""Teacher-generated draft data: what the teacher itself would say, cached, resumable, refused when stale;
and `compress distill --objective draft` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from compress.cli import app
from compress.distill.config import DistillSpec
from compress.distill.draft_data import teacher_sequences
from compress.errors import CompressError
from conftest import CALIB_TEXT


def spec(**kw) -> DistillSpec:
    return DistillSpec(data=CALIB_TEXT, objective="draft", seq_len=12, draft_prompt_tokens=4, draft_prompts=5, batch_size=2, **kw)


def test_greedy_sequences_are_the_teachers_argmax_continuations(tiny_llama, tmp_path):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokens = torch.arange(100) % 250
    seqs = teacher_sequences(teacher, tiny_llama, tokens, spec(draft_temperature=0), tmp_path / "c")
    assert seqs.shape == (5, 12)
    windows = {tuple(w) for w in tokens.view(25, 4).tolist()}
    assert all(tuple(s[:4].tolist()) in windows for s in seqs)  # prompts are windows of the text
    with torch.no_grad():
        logits = teacher(seqs).logits
    assert torch.equal(logits[:, 3:-1].argmax(-1), seqs[:, 4:])  # each generated token is the teacher's argmax


def test_sampled_cache_resumes_to_the_same_sequences_and_refuses_other_settings(tiny_llama, tmp_path):
    teacher = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    tokens = torch.arange(100) % 250
    cache = tmp_path / "c"
    first = teacher_sequences(teacher, tiny_llama, tokens, spec(), cache)
    assert sorted(p.name for p in cache.iterdir()) == ["batch-00000.safetensors", "batch-00001.safetensors", "batch-00002.safetensors", "settings.json"]
    (cache / "batch-00001.safetensors").unlink()  # interrupted: batch 1 never finished
    torch.manual_seed(123)  # the global RNG state does not matter
    assert torch.equal(teacher_sequences(teacher, tiny_llama, tokens, spec(), cache), first)
    with pytest.raises(CompressError, match="other temperature") as info:
        teacher_sequences(teacher, tiny_llama, tokens, spec(draft_temperature=0.5), cache)
    assert "\n" not in str(info.value)


def test_cli_distills_a_draft(tiny_llama, tmp_path):
    out = tmp_path / "draft"
    args = ["distill", str(tiny_llama), "-o", str(out), "--student", "layers:0", "--data", str(CALIB_TEXT), "--objective", "draft",
            "--draft-loss", "kl", "--draft-prompts", "4", "--draft-prompt-tokens", "8", "--seq-len", "24", "--steps", "2",
            "--batch-size", "2", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    stage = json.loads((out / "config.json").read_text())["compression"]["stages"][0]
    assert stage["objective"] == "draft" and stage["draft_loss"] == "kl"
    assert len(list((tmp_path / "draft-draft-data").glob("batch-*.safetensors"))) == 2
    bad = CliRunner().invoke(app, [*args[:-1], "--objective", "drafty", "--overwrite"])
    assert bad.exit_code == 2 and "objective" in bad.output
