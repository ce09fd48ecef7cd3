"""A distillation run end to end: students, data, ppl before/after, training, the output checkpoint.

`run_distill_recipe` is what `compress run` / `compress distill` call for a recipe with a ``distill:``
section. With compression stages (e.g. SparseGPT 2:4) the main process first writes the compressed
model to a staging folder beside the output, which then is the student (its sparsity masks fixed),
and the staging folder is removed at the end. Under ``accelerate launch`` every process runs this;
only the main one compresses, evaluates and writes.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from compress import __version__
from compress.checkpoints.calibration import load_calibration_text
from compress.distill.config import DistillSpec, Objective, StudentSpec
from compress.distill.draft_data import cached_sequences, teacher_sequences
from compress.distill.student import build_student, sparsity_masks
from compress.distill.train import StepLog, make_accelerator, token_windows, train
from compress.errors import CompressError
from compress.eval.perplexity import EvalResult, evaluate
from compress.checkpoints.loading import _quiet_transformers, load_model, load_tokenizer, read_eval_text
from compress.checkpoints.output import OutputDir, dir_size, run_inputs, write_config, write_model_card
from compress.run.compression import run_stages

log = logging.getLogger(__name__)

LOG_FILE = "distill_log.json"
SIDE_FILE_MARKERS = ("token", "vocab", "merges", "chat_template", "generation_config", "preprocessor")


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Tokenizer and generation files only: the source's other files (model card, training log) describe another model."""
    for f in sorted(src.iterdir()):
        if f.is_file() and any(m in f.name for m in SIDE_FILE_MARKERS) and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


@dataclass
class DistillResult:
    output: Path
    student: str
    steps: int
    processes: int
    history: list[StepLog]
    masked_layers: int
    seconds: float
    output_bytes: int
    before: EvalResult | None = None
    after: EvalResult | None = None
    compression: Any = None  # the RunResult of the compression stages, if any
    extra: dict = field(default_factory=dict)

    @property
    def evaluation(self) -> EvalResult | None:
        return self.after

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "student": self.student,
            "steps": self.steps,
            "processes": self.processes,
            "masked_layers": self.masked_layers,
            "seconds": round(self.seconds, 3),
            "output_bytes": self.output_bytes,
            "final_loss": self.history[-1].loss if self.history else None,
            "history": [asdict(h) for h in self.history],
            "before": self.before.to_dict() if self.before else None,
            "after": self.after.to_dict() if self.after else None,
            "compression": self.compression.to_dict() if self.compression is not None else None,
        }


def _evaluate(model, teacher, ids: torch.Tensor | None, ev, device, label: str, progress) -> EvalResult | None:
    if ids is None:
        return None
    on_batch = (lambda d, t: progress(label, d, t)) if progress else None
    return evaluate(model, ids, ctx=ev.ctx, stride=ev.stride, batch_size=ev.batch_size, reference=teacher, device=device, on_batch=on_batch)


def _record(teacher: Path, spec: DistillSpec, processes: int, command: str | None) -> dict[str, Any]:
    settings = spec.model_dump(mode="json", exclude={"student", "resume", "checkpoint_dir", "save_every", "eval_max_tokens", "draft_cache"})
    student = spec.student.model_dump(mode="json", exclude_none=True) if spec.student else None
    return {
        "tool": "llm-compress",
        "tool_version": __version__,
        "source_model": str(teacher),
        "format": "dense",
        "stages": [{"method": "distill", "teacher": str(teacher), "student": student, "processes": processes, **settings}],
        "calibration": None,
        "inputs": run_inputs(teacher, training=spec.data),
        **({"command": command} if command else {}),
    }


def run_distill(
    teacher_dir: Path,
    spec: DistillSpec,
    output,  # compress.run.recipe.OutputSpec
    evaluation=None,  # compress.run.recipe.EvaluationSpec
    device: str = "cpu",
    accelerator=None,
    progress: Callable[[str, int, int], None] | None = None,
    on_step: Callable[[StepLog], None] | None = None,
    command: str | None = None,
    trust_remote_code: bool = False,
) -> DistillResult:
    """Distil ``teacher_dir`` into ``spec.student`` and write the student to ``output.path`` atomically."""
    if spec.student is None:
        raise CompressError("distill needs a student: give student (a checkpoint, layers, every or config)")
    start = time.perf_counter()
    accelerator = accelerator or make_accelerator(spec, device)
    main = accelerator.is_main_process
    out = OutputDir(output.path, output.overwrite, protect=teacher_dir)
    if spec.student.checkpoint is not None and output.path.resolve() == spec.student.checkpoint.resolve():
        raise CompressError(f"output {output.path} is the student checkpoint: choose another output directory")
    checkpoint_dir = spec.checkpoint_dir or output.path.parent / f"{output.path.name}-checkpoints"
    tokenizer = load_tokenizer(teacher_dir)
    text = load_calibration_text(spec.data)
    windows = token_windows(tokenizer, text, spec.seq_len) if spec.objective is Objective.kd else None
    eval_ids = None
    if evaluation is not None and main:
        ids = tokenizer(read_eval_text(evaluation.text), add_special_tokens=False, verbose=False)["input_ids"]
        limit = evaluation.max_tokens or spec.eval_max_tokens
        eval_ids = torch.tensor(ids[:limit] if limit else ids, dtype=torch.long)
    teacher = load_model(teacher_dir, torch.device("cpu"), trust_remote_code=trust_remote_code)
    if windows is None:  # the draft objective trains on the teacher's own sequences (generated once, cached)
        cache = spec.draft_cache or output.path.parent / f"{output.path.name}-draft-data"
        if main:
            tokens = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
            teacher_sequences(teacher.to(accelerator.device), teacher_dir, tokens, spec, cache, progress)
        accelerator.wait_for_everyone()
        windows = cached_sequences(cache, spec)
    student, side_dir = build_student(teacher, teacher_dir, spec.student, trust_remote_code)
    masks = sparsity_masks(student) if spec.keep_masks else {}
    dev = accelerator.device
    before = _evaluate(student.to(dev), teacher.to(dev), eval_ids, evaluation, dev, "ppl before", progress)
    total = spec.steps

    def step_done(entry: StepLog) -> None:
        if progress:
            progress("distilling", entry.step, total)
        if on_step:
            on_step(entry)

    student, history = train(accelerator, teacher, student, windows, spec, checkpoint_dir, masks, step_done)
    after = _evaluate(student, teacher, eval_ids, evaluation, dev, "ppl after", progress)
    result = DistillResult(output.path, spec.student.describe(), spec.steps, accelerator.num_processes, history,
                           len(masks), 0.0, 0, before, after)
    if main:
        record = _record(teacher_dir, spec, accelerator.num_processes, command)
        with out as tmp:
            with _quiet_transformers():
                student.to("cpu").save_pretrained(tmp)
            _copy_tokenizer_files(side_dir, tmp)
            write_config(tmp, tmp, record)  # the student's own earlier record (e.g. pruning) moves to history
            figures = {}
            if before is not None and after is not None:
                name = evaluation.text.name
                figures = {
                    f"perplexity on `{name}` before → after": f"{before.perplexity:.4f} → {after.perplexity:.4f}",
                    "teacher's perplexity": f"{after.ref_perplexity:.4f}",
                    "mean KLD vs teacher before → after": f"{before.kld:.5f} → {after.kld:.5f}",
                }
            write_model_card(tmp, output.path.name, record, figures)
            (tmp / LOG_FILE).write_text(json.dumps(result.to_dict(), indent=1) + "\n")
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # only needed to resume an unfinished run
        result.output_bytes = dir_size(output.path)
    accelerator.wait_for_everyone()
    result.seconds = time.perf_counter() - start
    return result


def run_distill_recipe(recipe, progress=None, command: str | None = None, on_layer=None, on_step=None) -> DistillResult:
    """Run the recipe's compression stages (if any), then distil the result (or the given student)."""
    spec: DistillSpec = recipe.distill
    if recipe.resume:  # a recipe's resume: true, as distill's own --resume
        spec = spec.model_copy(update={"resume": True})
    accelerator = make_accelerator(spec, recipe.device.value)
    compression, staging = None, None
    if recipe.stages:
        if spec.student is not None:
            raise CompressError("a recipe with stages distils the compressed model: drop distill.student")
        staging = recipe.output.path.parent / f".{recipe.output.path.name}.compressed"
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            stage_recipe = recipe.model_copy(update={"distill": None, "evaluation": None, "export": None, "resume": False,
                                                     "output": recipe.output.model_copy(update={"path": staging, "overwrite": True})})
            compression = run_stages(stage_recipe, progress, command, on_layer)
        accelerator.wait_for_everyone()
        spec = spec.model_copy(update={"student": StudentSpec(checkpoint=staging)})
    try:
        result = run_distill(recipe.model, spec, recipe.output, recipe.evaluation, recipe.device.value,
                             accelerator, progress, on_step, command, recipe.trust_remote_code)
    finally:
        if staging is not None and accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
    result.compression = compression
    if recipe.export is not None and accelerator.is_main_process:  # the distilled checkpoint, as one GGUF file
        from compress.run.export_stage import export_from_spec

        export_from_spec(recipe.output.path, recipe.export, progress, recipe.calibration, recipe.device.value)
    return result
