"""lm-evaluation-harness on our loaded models, offline, with a shipped local task.

The task ``shakespeare_lastword`` (``eval/assets/lm_eval/``) is a LAMBADA-style cloze on held-out verse:
the context is a line of The Tempest (shared corpus ``shakespeare/test.txt``, never trained on) preceded
by the line before it, with its last word removed; the target is that word. lm-eval scores it as a
``loglikelihood`` task (``acc``: the target is the greedy continuation; ``perplexity`` of the target), and
``shakespeare_lastword_mc`` as ``multiple_choice`` among the true word and three other line-final words
(``acc``, ``acc_norm``), Paperno et al. 2016 (LAMBADA) for the protocol.

Local data. Any task runs offline when its YAML names a local file: ``dataset_path: json`` (or ``csv``,
``parquet``, ``text``) and ``dataset_kwargs: {data_files: {test: FILE}}``. `load_task_configs` reads such
YAMLs from a folder and resolves relative ``data_files`` against the YAML's folder, so a task folder can
be moved anywhere; tasks not found there are looked up by name through lm-eval's own registry
(``--include-path`` adds folders to it).

Models. `run_lm_eval` wraps the model `compress.checkpoints.loading.load_model` loads (dense, fake-quantized or
packed with `QuantLinear` layers) in lm-eval's ``HFLM(pretrained=<nn.Module>, tokenizer=...)``: the same
weights `compress eval ppl` measures, nothing downloaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

from compress.errors import CompressError

log = logging.getLogger(__name__)
TASK_DIR = Path(__file__).resolve().parent / "assets" / "lm_eval"
_WORD = re.compile(r"^(.*\S)\s+([A-Za-z][a-z']{2,})[.,;:!?]*$")


def build_cloze_docs(text: str, n: int, seed: int = 0, choices: int = 4) -> list[dict[str, Any]]:
    """Up to ``n`` cloze documents from ``text``: dialogue lines of 6+ words whose last word is a plain word.

    Each doc: ``context`` (previous line, newline, the line without its last word), ``target`` (" word"),
    ``choices`` (the target among ``choices - 1`` other line-final words, seeded order) and ``label``.
    """
    lines = [ln.strip() for ln in text.splitlines()]
    candidates = []
    for prev, line in zip(lines, lines[1:]):
        m = _WORD.match(line)
        if m is None or len(line.split()) < 6 or not prev or line.isupper() or prev.isupper():
            continue
        candidates.append((f"{prev}\n{m.group(1)}", m.group(2)))
    rng = random.Random(seed)
    picked = rng.sample(candidates, min(n, len(candidates)))
    vocabulary = sorted({word for _, word in candidates})
    docs = []
    for context, word in picked:
        others = rng.sample([w for w in vocabulary if w != word], choices - 1)
        options = [" " + w for w in [word, *others]]
        rng.shuffle(options)
        docs.append({"context": context, "target": " " + word, "choices": options, "label": options.index(" " + word)})
    return docs


def load_task_configs(task_dir: Path = TASK_DIR) -> dict[str, dict[str, Any]]:
    """The task YAMLs in ``task_dir`` by task name, relative ``data_files`` made absolute."""
    import yaml

    configs = {}
    for path in sorted(task_dir.glob("*.yaml")):
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            log.warning("%s is not plain YAML (lm-eval tags?); load it with --include-path instead", path)
            continue
        if not isinstance(config, dict) or "task" not in config:
            continue
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):
            config["dataset_kwargs"]["data_files"] = {k: str((path.parent / v).resolve()) for k, v in files.items()}
        elif isinstance(files, str):
            config["dataset_kwargs"]["data_files"] = str((path.parent / files).resolve())
        configs[config["task"]] = config
    return configs


def summarize(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from lm-eval's results (``acc,none`` -> ``acc``; stderr kept)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            name, _, _ = key.partition(",")
            if isinstance(value, (int, float)) and name != "alias":
                row[name] = float(value)
        out[task] = row
    return out


def run_lm_eval(
    model_path: Path,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    include_path: Path | None = None,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, float]]:
    """lm-eval ``tasks`` on the checkpoint at ``model_path`` (loaded by our loader); ``{task: {metric: value}}``."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never reach the Hub: local data only
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise CompressError("lm-eval is not installed: pip install 'llm-compress[lmeval]' (or pip install lm-eval)") from None
    from compress.checkpoints.loading import load_model, load_tokenizer, resolve_device

    if not tasks:
        raise CompressError("no lm-eval task given: pass --tasks, e.g. --tasks shakespeare_lastword")
    local = load_task_configs()
    if include_path is not None:
        if not include_path.is_dir():
            raise CompressError(f"--include-path {include_path} is not a folder of lm-eval task YAMLs")
        local.update(load_task_configs(include_path))
    others = [t for t in tasks if t not in local]
    if others:  # indexing lm-eval's own task registry takes a while: only when a task is not ours
        manager = TaskManager(include_path=str(include_path) if include_path else None)
        unknown = [t for t in others if t not in manager.all_tasks]
        if unknown:
            raise CompressError(f"unknown lm-eval task {unknown[0]!r}: use {', '.join(sorted(local))} or a task YAML under --include-path")
    else:
        manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    dev = resolve_device(device)
    model = load_model(model_path, dev)
    tokenizer = load_tokenizer(model_path)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(dev))
    with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints progress notes on stdout; ours stays clean for --json
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[local.get(t, t) for t in tasks], limit=limit, task_manager=manager, num_fewshot=num_fewshot,
            log_samples=False, bootstrap_iters=1000, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
        )
    return summarize(results or {})
