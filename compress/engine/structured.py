"""Structured pruning on a checkpoint: importance from calibration activations, then the smaller checkpoint.

1. `collect_scores` runs the calibration windows through the model one decoder block at a time (as the
   engine does: block 0's inputs captured once, each block's outputs the next one's inputs, one block's
   weights in memory) and accumulates, with hooks on the modules the architecture's `StructuredLayout`
   names, the importance of every head, MLP channel and hidden channel, and each block's influence.
   `block_output_change` is the alternative block score: the mean KL divergence of the model's
   next-token distribution when the block is skipped (the whole model in memory, L + 1 passes).
2. `write_pruned` streams every tensor of the checkpoint through `compress.pruners.structured.prune_tensor`
   into a new sharded checkpoint; the caller writes the config from `pruned_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from compress.checkpoints.model_io import ModelHandle
from compress.checkpoints.shards import ShardedWriter
from compress.errors import CompressError
from compress.pruners.structured import Dims, Geometry, StructuredLayout, StructuredPlan, activation_score, block_influence, prune_tensor

ProgressFn = Callable[[str, int, int], None]


@dataclass
class StructuredScores:
    """Importance (higher: keep): ``heads [L, heads]``, ``mlp [L, mlp]``, ``hidden [hidden]``, ``blocks [L]``."""

    heads: torch.Tensor
    mlp: torch.Tensor
    hidden: torch.Tensor
    blocks: torch.Tensor


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _first(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _module(block: nn.Module, name: str, model_type: str) -> nn.Module:
    try:
        return block.get_submodule(name)
    except AttributeError:
        raise CompressError(f"{model_type} block has no module {name!r}: fix compress/checkpoints/architecture.py STRUCTURED_LAYOUTS") from None


@torch.no_grad()
def collect_scores(handle: ModelHandle, layout: StructuredLayout, geometry: Geometry, calibration: torch.Tensor,
                   device: torch.device, batch_size: int = 8, progress: ProgressFn | None = None) -> StructuredScores:
    """Activation importance of every structure, one block in memory at a time (float32)."""
    progress = progress or (lambda phase, done, total: None)
    g, model_type = geometry, handle.config.model_type
    heads, mlp = torch.zeros(g.layers, g.heads), torch.zeros(g.layers, g.mlp)
    hidden, blocks = torch.zeros(g.hidden), torch.zeros(g.layers)
    from compress.engine.block_engine import Engine  # not at import time: the engine imports the methods package

    inputs = Engine(handle, [], device, batch_size=batch_size).capture_inputs(calibration)
    for i, block in enumerate(handle.blocks):
        handle.materialize(block, handle.block_name(i), device, torch.float32)
        sums = {"heads": torch.zeros(g.heads), "mlp": torch.zeros(g.mlp), "hidden": torch.zeros(g.hidden)}

        def add(key: str, x: torch.Tensor, groups: int) -> None:
            sums[key] += activation_score(x, groups).cpu()

        hooks = [
            _module(block, layout.head_outputs, model_type).register_forward_pre_hook(lambda m, a: add("heads", a[0], g.heads)),
            _module(block, layout.mlp_activations, model_type).register_forward_pre_hook(lambda m, a: add("mlp", a[0], g.mlp)),
            *(_module(block, n, model_type).register_forward_hook(lambda m, a, out: add("hidden", _first(out), g.hidden))
              for n in layout.hidden_norms),
        ]
        influence, tokens, outputs = 0.0, 0, []
        try:
            for h, args, kwargs in inputs:
                out = _first(block(h, *args, **kwargs))
                total, count = block_influence(h, out)
                influence, tokens = influence + total, tokens + count
                outputs.append((out, args, kwargs))
        finally:
            for hook in hooks:
                hook.remove()
            handle.release(block)
        inputs = outputs
        heads[i], mlp[i], blocks[i] = sums["heads"].sqrt(), sums["mlp"].sqrt(), influence / max(tokens, 1)
        hidden += sums["hidden"]  # squares summed over every norm of every block, rooted below
        progress("importance", i + 1, g.layers)
    return StructuredScores(heads, mlp, hidden.sqrt(), blocks)


@torch.no_grad()
def block_output_change(model: nn.Module, blocks: nn.ModuleList, calibration: torch.Tensor, batch_size: int = 8,
                        progress: ProgressFn | None = None) -> torch.Tensor:
    """Per block ``[L]``: mean over calibration tokens of KL(P_model ‖ P_model without the block)."""
    progress = progress or (lambda phase, done, total: None)
    device = next(model.parameters()).device
    totals, tokens = torch.zeros(len(blocks), dtype=torch.float64), 0
    skip = lambda m, args, kwargs, out: (  # noqa: E731 - the block passes its input through unchanged
        _hidden_of(args, kwargs) if not isinstance(out, (tuple, list)) else (_hidden_of(args, kwargs), *out[1:]))
    batches = calibration.split(batch_size)
    for b, batch in enumerate(batches):
        ids = batch.to(device)
        ref = F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
        for i, block in enumerate(blocks):
            hook = block.register_forward_hook(skip, with_kwargs=True)
            try:
                logp = F.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            finally:
                hook.remove()
            totals[i] += float((ref.exp() * (ref - logp)).sum())
        tokens += ids.numel()
        progress("block output change", b + 1, len(batches))
    return (totals / tokens).float()


def tensor_dims(name: str, handle: ModelHandle, layout: StructuredLayout) -> tuple[int | None, Dims, bool]:
    """(block index or None, axes of each dim, is an RMSNorm weight) of model parameter ``name``."""
    prefix = handle.blocks_name + "."
    if name.startswith(prefix):
        index, _, rest = name[len(prefix):].partition(".")
        table, key, block = layout.block_tensors, rest, int(index)
    else:
        table, key, block = layout.outer_tensors, name, None
    if key not in table:
        raise CompressError(
            f"tensor {name} is not in the structured-pruning layout of {handle.config.model_type}: add it to "
            "compress/checkpoints/architecture.py STRUCTURED_LAYOUTS"
        )
    return block, table[key], key in layout.rms_norms


def stored_parameters(handle: ModelHandle) -> list[str]:
    """The model's parameter names that the checkpoint stores (tied copies are re-tied at load)."""
    tied = handle.tied_parameter_names()
    return [n for n, _ in handle.model.named_parameters(remove_duplicate=False) if n not in tied]


def write_pruned(handle: ModelHandle, layout: StructuredLayout, plan: StructuredPlan, directory: Path,
                 rescale_norms: bool = True, shard_bytes: int = 256 << 20) -> None:
    """Write the pruned weights of ``handle``'s checkpoint into ``directory`` (sharded safetensors),
    one tensor at a time, in each tensor's stored dtype; removed blocks are dropped, kept ones renumbered."""
    names = stored_parameters(handle)
    where = {name: tensor_dims(name, handle, layout) for name in names}  # every tensor checked before writing
    position = {old: new for new, old in enumerate(plan.layers)}
    writer = ShardedWriter(directory, shard_bytes)
    for name in names:
        block, dims, rms_norm = where[name]
        if block is not None and block not in position:
            continue
        tensor = handle.reader.get(handle.checkpoint_key(name))
        try:
            pruned = prune_tensor(tensor, dims, plan, None if block is None else position[block], rms_norm, rescale_norms)
        except ValueError as exc:
            raise CompressError(f"cannot prune {name}: {exc}: the checkpoint does not match its config.json") from None
        if block is not None:
            name = f"{handle.blocks_name}.{position[block]}.{name[len(handle.blocks_name) + 1:].partition('.')[2]}"
        writer.add(name, pruned.contiguous())
    writer.close()
