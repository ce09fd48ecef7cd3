"""`compress eval lm-eval`: lm-evaluation-harness on our loaded (also packed) models with the shipped local task;
its accuracy equals a textbook multiple-choice scoring of the same documents with the same model."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from compress.cli import app
from conftest import REFERENCE_MODEL

pytest.importorskip("lm_eval")
runner = CliRunner()
LIMIT = 12


def textbook_mc_accuracy(model_dir, docs) -> float:
    """Sum of the choice tokens' log-probabilities after the context; correct when the true choice is the max."""
    from compress.checkpoints.loading import load_model, load_tokenizer

    model, tok = load_model(model_dir, torch.device("cpu")), load_tokenizer(model_dir)
    right = 0
    with torch.inference_mode():
        for doc in docs:
            ctx = tok(doc["context"], add_special_tokens=False)["input_ids"]
            scores = []
            for choice in doc["choices"]:
                whole = tok(doc["context"] + choice, add_special_tokens=False)["input_ids"]
                cont = whole[len(ctx):]
                logp = model(input_ids=torch.tensor([whole])).logits[0].log_softmax(-1)
                scores.append(sum(logp[len(whole) - len(cont) - 1 + i, t].item() for i, t in enumerate(cont)))
            right += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
    return right / len(docs)


def test_shipped_task_is_local_and_well_formed():
    from compress.eval.lm_eval_task import TASK_DIR, load_task_configs

    configs = load_task_configs()
    assert set(configs) == {"shakespeare_lastword", "shakespeare_lastword_mc"}
    for cfg in configs.values():
        data = cfg["dataset_kwargs"]["data_files"]["test"]
        assert data.startswith(str(TASK_DIR)) and cfg["dataset_path"] == "json"
    docs = [json.loads(line) for line in (TASK_DIR / "shakespeare_lastword.jsonl").read_text().splitlines()]
    assert len(docs) == 300 and all(d["choices"][d["label"]] == d["target"] for d in docs)
    assert len({d["context"] for d in docs}) == len(docs)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from compress.run.recipe import parse_recipe
    from compress.run.runner import run_recipe

    out = tmp_path_factory.mktemp("lm-eval") / "ref-rtn-w3"
    run_recipe(parse_recipe({"model": REFERENCE_MODEL, "stages": [{"method": "rtn", "bits": 3, "group_size": 64}], "output": {"path": out}}))
    return out


def test_lm_eval_on_the_reference_and_a_packed_copy(quantized):
    from compress.eval.lm_eval_task import TASK_DIR

    docs = [json.loads(line) for line in (TASK_DIR / "shakespeare_lastword.jsonl").read_text().splitlines()][:LIMIT]
    for model in (REFERENCE_MODEL, quantized):
        tasks = "shakespeare_lastword_mc,shakespeare_lastword"  # the latter bootstraps a perplexity: lm-eval prints
        result = runner.invoke(app, ["eval", "lm-eval", str(model), "--tasks", tasks, "--limit", str(LIMIT), "--json"])
        assert result.exit_code == 0, result.output
        both = json.loads(result.stdout)["tasks"]  # stdout holds nothing but our JSON
        assert 0 <= both["shakespeare_lastword"]["acc"] <= 1 and both["shakespeare_lastword"]["perplexity"] > 1
        scores = both["shakespeare_lastword_mc"]
        assert scores["sample_len"] == LIMIT
        assert scores["acc"] == pytest.approx(textbook_mc_accuracy(model, docs))


def test_unknown_task_is_a_one_line_error():
    result = runner.invoke(app, ["eval", "lm-eval", str(REFERENCE_MODEL), "--tasks", "no_such_task", "--limit", "2"])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output


def test_report_adds_lm_eval_scores(quantized, tmp_path):
    from compress.eval.lm_eval_task import run_lm_eval
    from conftest import EVAL_TEXT

    result = runner.invoke(app, ["report", str(quantized), "--baseline", str(REFERENCE_MODEL), "--text", str(EVAL_TEXT),
                                 "--ctx", "128", "--max-tokens", "400", "-o", str(tmp_path), "--tasks", "shakespeare_lastword_mc",
                                 "--limit", "4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    alone = run_lm_eval(quantized, ["shakespeare_lastword_mc"], limit=4)["shakespeare_lastword_mc"]
    assert report["outputs"][0]["extra"]["shakespeare_lastword_mc.acc"] == alone["acc"]
    assert "shakespeare_lastword_mc.acc" in report["baseline"]["extra"]
    assert "shakespeare_lastword_mc.acc=" in (tmp_path / "report.md").read_text()
