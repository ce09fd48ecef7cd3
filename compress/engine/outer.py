"""The tensors outside the decoder blocks (embeddings, final norm, output layer), written after the last block:
copied from the checkpoint, or transformed first by a stage that selects them (only methods that need no
statistics may: `compress.engine.checks`)."""

from __future__ import annotations

from typing import Callable

import torch

from compress.checkpoints.model_io import ModelHandle
from compress.checkpoints.shards import ShardedWriter
from compress.engine.methods.base import LayerReport
from compress.engine.outcomes import LayerOutcomes
from compress.engine.stages import Stage


def write_outer(handle: ModelHandle, stages: list[Stage], in_blocks: tuple[str, ...], outcomes: LayerOutcomes,
                writer: ShardedWriter, device: torch.device, dtype: torch.dtype,
                on_layer: Callable[[LayerReport], None]) -> list[LayerReport]:
    """Every parameter outside ``in_blocks`` (the blocks' name prefixes) to ``writer``; the reports of the layers
    transformed on ``device`` in ``dtype``."""
    reports = []
    outer_layers = {
        f"{name}.weight": (stage.method_for(name), name, module)
        for stage in stages
        for name, module in stage.layers.items()
        if not name.startswith(in_blocks)
    }
    tied = handle.tied_parameter_names()
    for name, _ in handle.model.named_parameters(remove_duplicate=False):
        if name.startswith(in_blocks) or name in tied:
            continue  # blocks are written as they finish; tied copies are re-tied at load
        if name in outer_layers:
            method, layer_name, module = outer_layers[name]
            stored = handle.materialize(module, layer_name, device, dtype, only={"weight"})
            for report in method.transform_block(module, {layer_name: module}, {}):
                on_layer(report)
                reports.append(report)
            outcomes.keep(method, {layer_name: module})
            tensors = outcomes.packed_tensors(layer_name, module, stored["weight"])
            for suffix, t in (tensors or {"weight": module.weight.detach().to(stored["weight"])}).items():
                writer.add(f"{layer_name}.{suffix}", t)
            handle.release(module, only={"weight"})
        else:
            writer.add(name, handle.reader.get(handle.checkpoint_key(name)))
    return reports
