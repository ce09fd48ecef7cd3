"""Run a `Recipe`: the one entry point behind `compress run` and every compressing CLI command."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from compress.checkpoints.gguf_source import checkpoint_source, is_gguf_file
from compress.engine.block_engine import LayerFn, ProgressFn
from compress.errors import CompressError
from compress.run.compression import RunResult, run_stages
from compress.run.distill import DistillResult, run_distill_recipe
from compress.run.recipe import OutputSpec, Recipe, parse_recipe


def run_recipe(
    recipe: Recipe, progress: ProgressFn | None = None, command: str | None = None, on_layer: LayerFn | None = None,
    window_chunks: bool = False,
) -> RunResult | DistillResult:
    """Compress ``recipe.model`` as described and write ``recipe.output.path`` atomically. A GGUF file as
    the model is converted to a float checkpoint in a scratch directory first (removed afterwards), and so is a
    first stage that rewrites the checkpoint keeping its shapes (a rotation) when stages follow it.
    ``window_chunks``: the engine's one pass in chunks of windows (`compress.engine.block_engine.Engine`; the
    ``compress`` command asks for it where it runs under `compress.cli.allocator.CALIBRATING`)."""
    if is_gguf_file(recipe.model):
        with checkpoint_source(recipe.model, progress) as converted:
            return run_recipe(recipe.with_converted_model(converted), progress, command, on_layer, window_chunks)
    if len(recipe.stages) > 1 and getattr(recipe.stages[0].build(), "keeps_shapes", False):
        return _after_rewrite(recipe, progress, command, on_layer, window_chunks)
    if recipe.distill is not None:  # the stages (if any), then distillation into their result
        return run_distill_recipe(recipe, progress, command, on_layer)
    return run_stages(recipe, progress, command, on_layer, window_chunks)


def rotated_copy(model: Path, kind: str, directory: Path, progress: ProgressFn | None = None) -> tuple[Path, list[str]]:
    """``model`` with a rotation of ``kind`` fused (the `rotate` method), written to ``directory``; and its notes."""
    recipe = parse_recipe({"model": model, "stages": [{"method": "rotate", "kind": kind}], "output": {"path": directory}})
    return directory, run_stages(recipe, progress).notes


def _after_rewrite(recipe: Recipe, progress, command, on_layer, window_chunks) -> RunResult | DistillResult:
    """The first stage into a scratch checkpoint beside the output (a temporary name the next run of this output
    reports if this one is killed), then the others on it; the output's record keeps the first in its history."""
    first_method = recipe.stages[0].method
    if recipe.resume:
        raise CompressError(f"--resume: stage 1 ({first_method}) rewrites the checkpoint before the others, "
                            "which records no progress: run without --resume")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would write a checkpoint of its own
        raise CompressError(f"stage 1 ({first_method}) rewrites the checkpoint in one process: run a recipe with that stage alone "
                            "first, then launch the other stages on its output")
    out = recipe.output.path
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-") as scratch:
        model = Path(scratch) / "model"
        first = recipe.model_copy(update={
            "stages": recipe.stages[:1], "output": OutputSpec(path=model), "evaluation": None, "export": None,
            "kv_cache": None, "distill": None,
        })
        rewritten = run_stages(first, progress, command)
        rest = recipe.model_copy(update={"stages": recipe.stages[1:]}).with_converted_model(model)
        result = run_recipe(rest, progress, command, on_layer, window_chunks)
    if isinstance(result, RunResult):
        result.notes[:0] = rewritten.notes
    return result
