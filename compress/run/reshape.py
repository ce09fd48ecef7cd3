"""A recipe whose stage changes the model's shapes (structured pruning): the new checkpoint, its config,
record, model card and evaluation. `compress.run.compression.run_stages` calls it for such a stage."""

from __future__ import annotations

import json
import time

from compress.checkpoints.calibration import load_calibration
from compress.checkpoints.loading import load_tokenizer, resolve_device
from compress.checkpoints.model_io import open_model
from compress.checkpoints.output import OutputDir, copy_side_files, write_config, write_model_card
from compress.engine.block_engine import EngineResult, ProgressFn, peak_rss_bytes
from compress.engine.methods.base import CheckpointMethod
from compress.errors import CompressError
from compress.eval.checkpoint import evaluate_checkpoint


def check_reshaping_stages(recipe, methods: list) -> CheckpointMethod | None:
    """The recipe's checkpoint-rewriting method, if it has one, on the whole model: one that changes the shapes must be
    the only stage; one that keeps them runs first (`compress.run.runner` runs the others on its output)."""
    reshaping = [i for i, m in enumerate(methods) if isinstance(m, CheckpointMethod)]
    if not reshaping:
        return None
    index = reshaping[0]
    name = methods[index].name
    if len(methods) > 1 and methods[index].keeps_shapes:
        raise CompressError(f"stage {index + 1} ({name}) rewrites the whole checkpoint for the stages after it: make it stage 1")
    if len(methods) > 1:
        raise CompressError(
            f"stage {index + 1} ({name}) changes the model's shapes, so it must be the only stage: run the other stages "
            "on its output with a second command (distillation repair: a distill section after it)"
        )
    spec = recipe.stages[index]
    if spec.include or spec.exclude:
        raise CompressError(f"stage {index + 1} ({name}) rewrites the whole model: drop include/exclude")
    if recipe.kv_cache is not None:  # the scales are calibrated on the block engine, which a reshaping run bypasses
        raise CompressError(f"stage {index + 1} ({name}) writes a new checkpoint without KV-cache scales: drop kv_cache, "
                            "and calibrate them on its output with a second command (compress quantize --kv-cache)")
    return methods[index]


def run_reshaping(recipe, method: CheckpointMethod, record: dict, progress: ProgressFn | None = None):
    """Run ``method`` on ``recipe.model`` and write ``recipe.output.path`` atomically (then evaluate and
    export it). ``record``: the run's compression record. Returns the run's figures, its input's size in
    bytes, the evaluation (or None) and the method's notes."""
    start = time.perf_counter()
    device = resolve_device(recipe.device.value)
    handle = open_model(recipe.model, recipe.trust_remote_code)
    if getattr(handle.config, "quantization_config", None):
        raise CompressError(f"{recipe.model} is already quantized (quantization_config in config.json): start from the original checkpoint")
    cal = recipe.calibration
    calibration = None
    if cal is not None:
        calibration = load_calibration(cal.path, load_tokenizer(recipe.model), cal.samples, cal.seq_len, cal.seed)
    output = OutputDir(recipe.output.path, recipe.output.overwrite, protect=recipe.model)
    evaluation = None
    with output as tmp:
        rewritten = method.rewrite(handle, calibration, tmp, device, cal.batch_size if cal else 8, progress)
        copy_side_files(recipe.model, tmp)
        for name, text in rewritten.files.items():
            (tmp / name).write_text(text)
        (tmp / "config.json").write_text(json.dumps(rewritten.config, indent=2) + "\n")
        record["stages"][0] = {**record["stages"][0], **rewritten.record}
        write_config(tmp, tmp, record)
        figures = {"shape": rewritten.notes[0]} if rewritten.notes else {}
        if recipe.evaluation is not None:
            ev = recipe.evaluation
            on_batch = (lambda d, t: progress("evaluation", d, t)) if progress else None
            evaluation = evaluate_checkpoint(tmp, ev.text, ev.ctx, ev.stride, ev.batch_size, recipe.model, recipe.device.value,
                                             ev.max_tokens, on_batch)
            figures.update({
                f"perplexity on `{ev.text.name}` (ctx {ev.ctx})": f"{evaluation.perplexity:.4f}",
                "original model's perplexity": f"{evaluation.ref_perplexity:.4f}",
                "mean KLD vs original": f"{evaluation.kld:.5f}",
            })
        write_model_card(tmp, recipe.output.path.name, record, figures)
    if recipe.export is not None:
        from compress.run.export_stage import export_from_spec

        export_from_spec(recipe.output.path, recipe.export, progress, recipe.calibration, recipe.device.value)
    engine = EngineResult(blocks=len(handle.blocks), seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss_bytes())
    return engine, handle.reader.total_bytes(), evaluation, rewritten.notes
