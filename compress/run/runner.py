"""Run a `Recipe`: the one entry point behind `compress run` and every compressing CLI command."""

from __future__ import annotations

from compress.checkpoints.gguf_source import checkpoint_source, is_gguf_file
from compress.engine.block_engine import LayerFn, ProgressFn
from compress.run.compression import RunResult, run_stages
from compress.run.distill import DistillResult, run_distill_recipe
from compress.run.recipe import Recipe


def run_recipe(
    recipe: Recipe, progress: ProgressFn | None = None, command: str | None = None, on_layer: LayerFn | None = None,
    window_chunks: bool = False,
) -> RunResult | DistillResult:
    """Compress ``recipe.model`` as described and write ``recipe.output.path`` atomically. A GGUF file as
    the model is converted to a float checkpoint in a scratch directory first (removed afterwards).
    ``window_chunks``: the engine's one pass in chunks of windows (`compress.engine.block_engine.Engine`; the
    ``compress`` command asks for it where it runs under `compress.cli.allocator.CALIBRATING`)."""
    if is_gguf_file(recipe.model):
        with checkpoint_source(recipe.model, progress) as converted:
            return run_recipe(recipe.with_converted_model(converted), progress, command, on_layer, window_chunks)
    if recipe.distill is not None:  # the stages (if any), then distillation into their result
        return run_distill_recipe(recipe, progress, command, on_layer)
    return run_stages(recipe, progress, command, on_layer, window_chunks)
