"""The training loop: data order, LR schedule, fixed sparsity masks, checkpoints and --resume."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL
from references import one_line_error
from safetensors.torch import load_file

from compress.distill.config import DistillSpec, StudentSpec
from compress.run.distill import run_distill
from compress.distill.train import batch_windows, lr_factor
from compress.errors import CompressError
from compress.pruners.masks import is_nm_sparse
from compress.run.recipe import EvaluationSpec, OutputSpec


def _spec(**kw) -> DistillSpec:
    base = dict(data=CALIB_TEXT, student=StudentSpec(every=2), steps=4, batch_size=2, seq_len=32, lr=3e-3, warmup_steps=1)
    return DistillSpec(**{**base, **kw})


def test_each_epoch_visits_every_window_once():
    seen = torch.cat([batch_windows(10, 5, step, seed=3) for step in range(4)])
    assert sorted(seen[:10].tolist()) == list(range(10)) and sorted(seen[10:].tolist()) == list(range(10))
    assert not torch.equal(seen[:10], seen[10:])  # a new permutation per epoch
    assert torch.equal(batch_windows(10, 5, 2, seed=3), batch_windows(10, 5, 2, seed=3))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = _spec(steps=110, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(110, cfg) == pytest.approx(0.1)


def test_resume_continues_from_the_checkpoint_and_ends_with_the_same_weights(tiny_llama, tmp_path):
    spec = _spec(save_every=2, checkpoint_dir=tmp_path / "ckpt")
    whole = run_distill(tiny_llama, spec, OutputSpec(path=tmp_path / "whole"))
    assert not (tmp_path / "ckpt").exists()  # removed once the output is complete

    def interrupt(entry):
        if entry.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_distill(tiny_llama, spec, OutputSpec(path=tmp_path / "resumed"), on_step=interrupt)
    assert not (tmp_path / "resumed").exists() and (tmp_path / "ckpt" / "step-2").is_dir()
    assert "--resume" in one_line_error(run_distill, tiny_llama, spec, OutputSpec(path=tmp_path / "resumed"))
    steps = []
    resumed = run_distill(tiny_llama, spec.model_copy(update={"resume": True}), OutputSpec(path=tmp_path / "resumed"),
                          on_step=lambda e: steps.append(e.step))
    assert steps == [3, 4]  # continued from the saved step
    assert [round(h.loss, 5) for h in resumed.history] == pytest.approx([round(h.loss, 5) for h in whole.history], abs=1e-4)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    changed = load_file(tiny_llama / "model.safetensors")["lm_head.weight"]
    assert not torch.allclose(a["lm_head.weight"], changed)  # training did move the weights


def test_resume_without_checkpoint_or_with_other_settings_is_an_error(tiny_llama, tmp_path):
    spec = _spec(resume=True, checkpoint_dir=tmp_path / "none")
    assert "no checkpoint" in one_line_error(run_distill, tiny_llama, spec, OutputSpec(path=tmp_path / "o"))


def test_pruned_student_stays_exactly_2_of_4(tiny_llama, tiny_tokenizer, tmp_path):
    from compress.checkpoints.loading import load_model

    model = load_model(tiny_llama, torch.device("cpu"))
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.mlp.down_proj):
                groups = lin.weight.abs().reshape(lin.weight.shape[0], -1, 4)
                keep = torch.ones_like(groups, dtype=torch.bool).scatter_(2, groups.argsort(2)[:, :, :2], False)
                lin.weight.mul_(keep.reshape(lin.weight.shape))
    pruned = tmp_path / "pruned"
    model.save_pretrained(pruned)
    tiny_tokenizer.save_pretrained(pruned)
    before = load_file(pruned / "model.safetensors")
    spec = _spec(student=StudentSpec(checkpoint=pruned), steps=3, lr=1e-2)
    result = run_distill(tiny_llama, spec, OutputSpec(path=tmp_path / "out"))
    assert result.masked_layers == 4
    after = load_file(tmp_path / "out" / "model.safetensors")
    for key, w in after.items():
        if "q_proj" in key or "down_proj" in key:
            assert is_nm_sparse(w, 2, 4), key
            assert torch.equal(w != 0, before[key] != 0), key  # the same positions, not just the same count
            assert not torch.equal(w, before[key]), key  # the kept weights were trained
        elif key.endswith("weight") and "norm" not in key:
            assert not torch.equal(w, before[key]), key


@pytest.mark.skipif(not (REFERENCE_MODEL / "model.safetensors").is_file(), reason="reference model not shipped")
def test_distilled_half_depth_student_beats_cross_entropy_only():
    """The issue's claim in small: same student, data, steps and schedule; only alpha differs."""
    import tempfile
    from pathlib import Path

    evaluation = EvaluationSpec(text=EVAL_TEXT, ctx=256, max_tokens=2048)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for alpha in (0.5, 0.0):
            spec = DistillSpec(data=CALIB_TEXT, student=StudentSpec(layers=[0, 2]), alpha=alpha, steps=6,
                               batch_size=4, seq_len=128, lr=5e-4, warmup_steps=1)
            result = run_distill(REFERENCE_MODEL, spec, OutputSpec(path=Path(tmp) / str(alpha)), evaluation)
            figures[alpha] = result.after
            assert result.after.perplexity < result.before.perplexity
    assert figures[0.5].perplexity < figures[0.0].perplexity
    assert figures[0.5].kld < figures[0.0].kld


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError):
        _spec(alpha=1.5)
    with pytest.raises(ValueError):
        _spec(tau=0)
    assert issubclass(CompressError, Exception)
