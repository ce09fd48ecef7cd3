"""A checkpoint with a rotation fused into its weights (`compress.quantizers.rotation`), written tensor by tensor:
R1 on the residual stream (every norm's scale folded into the layers that read it), R2 on each head's values, and
the offline half of each online rotation (R4: each down projection's weight; inputs: every linear layer's, times the
block rotation its input takes at run time).
Which tensor plays which part is the architecture's `RotationLayout`; a tensor it does not name is an error,
never silently copied."""

from __future__ import annotations

from pathlib import Path

import torch

from compress.checkpoints.model_io import ModelHandle
from compress.checkpoints.conversion import RenamingWriter
from compress.checkpoints.rotation_layouts import RotationLayout, matching
from compress.checkpoints.shards import ShardedWriter
from compress.engine.structured import stored_parameters
from compress.errors import CompressError
from compress.quantizers.rotation import (fold_norm, rotate_head_columns, rotate_head_rows, rotate_input_blocks, rotate_reader,
                                          rotate_writer, unit_norm)


def _unplaced(name: str) -> CompressError:
    return CompressError(f"a rotation does not know where {name} sits in the residual stream: "
                         "add it to compress/checkpoints/rotation_layouts.py")


class Rotator:
    """The rotated value of each stored tensor of ``handle``: ``q [hidden, hidden]`` (R1) or None, ``r [head_dim,
    head_dim]`` (R2, every block's), ``[blocks, head_dim, head_dim]`` (block i's ``r[i]``: SpinQuant's learned R2)
    or None, ``online``: block weight name -> ``M [b, b]``, the block of a rotation its input takes at run time
    (``b`` dividing its input width; R4 names the down projection), fused as ``W · diag(M, …, M)``. Without R1
    the residual stream, the norms and the embeddings stay as stored: no norm scale is folded."""

    def __init__(self, handle: ModelHandle, layout: RotationLayout, q: torch.Tensor | None, r: torch.Tensor | None,
                 online: dict[str, torch.Tensor] | None = None):
        self.handle, self.layout, self.q, self.r, self.online = handle, layout, q, r, online or {}
        self.reads = {reader: norm for norm, readers in layout.norms.items() for reader in readers}  # pattern -> norm

    def stored(self, name: str) -> torch.Tensor:
        return self.handle.reader.get(self.handle.checkpoint_key(name))

    def head_from(self, source: str) -> torch.Tensor:
        """The output layer from ``source`` (itself, or the embeddings it is tied to), final norm folded, rotated."""
        gamma = self.stored(self.layout.final_norm)
        return rotate_reader(fold_norm(self.stored(source), gamma, self.layout.norm_offset), self.q)

    def tensor(self, name: str) -> torch.Tensor:
        lay, blocks = self.layout, self.handle.blocks_name + "."
        if not name.startswith(blocks):
            if self.q is None and name in (lay.embeddings, lay.final_norm, lay.head):
                return self.stored(name)
            if name == lay.embeddings:
                return rotate_reader(self.stored(name), self.q)
            if name == lay.final_norm:
                return unit_norm(self.stored(name), lay.norm_offset)
            if name == lay.head:
                return self.head_from(name)
            raise _unplaced(name)
        prefix, _, rel = name[len(blocks):].partition(".")
        r = self.r if self.r is None or self.r.dim() == 2 else self.r[int(prefix)]
        prefix = blocks + prefix + "."
        weight = rel.removesuffix(".bias") + ".weight" if rel.endswith(".bias") else rel
        value = self.stored(name)
        if rel in lay.norms:
            return value if self.q is None else unit_norm(value, lay.norm_offset)
        reader = matching(weight, self.reads)
        if reader is not None and rel == weight and self.q is not None:  # a reader's weight: its norm's scale, then R1
            value = rotate_reader(fold_norm(value, self.stored(prefix + self.reads[reader]), lay.norm_offset), self.q)
        elif reader is not None:  # its bias, or its weight without R1, is unchanged
            pass
        elif matching(weight, lay.writers):  # a writer's weight or bias; the output projection's columns first take R2
            if r is not None and rel == lay.mixer:
                value = rotate_head_columns(value, r)
            if self.q is not None:
                value = rotate_writer(value, self.q)
        elif rel not in lay.untouched:
            raise _unplaced(name)
        if r is not None and weight == lay.values:
            value = rotate_head_rows(value, r)
        if rel in self.online:  # last: the input the layer sees at run time is the fused rotations' output times M
            value = rotate_input_blocks(value, self.online[rel])
        return value


def write_rotated(handle: ModelHandle, layout: RotationLayout, q: torch.Tensor | None, r: torch.Tensor | None, directory: Path,
                  shard_bytes: int = 256 << 20, online: dict[str, torch.Tensor] | None = None,
                  extra: dict[str, torch.Tensor] | None = None) -> bool:
    """Write ``handle``'s checkpoint with the rotation fused into ``directory`` (sharded safetensors, each tensor in
    its stored dtype), and the ``extra`` tensors (an online transform's matrix). Returns whether it untied the output
    layer from the embeddings: the output layer is the embeddings times the final norm's scale, so it is written on
    its own unless that scale is 1 (then both stay one tensor, the rotated embeddings)."""
    rotator = Rotator(handle, layout, q, r, online)
    names = stored_parameters(handle)
    tied = layout.head not in names
    gamma = rotator.stored(layout.final_norm)
    keep_tied = tied and (q is None or bool((gamma.double() + layout.norm_offset == 1.0).all()))
    writer = ShardedWriter(directory, shard_bytes)
    if handle.names is not None:  # the checkpoint's own names (Mixtral's experts are block_sparse_moe.experts.N.w1)
        writer = RenamingWriter(writer, handle.names)
    for name in names:
        writer.add(name, rotator.tensor(name).contiguous())
    if tied and not keep_tied:
        writer.add(layout.head, rotator.head_from(layout.embeddings).contiguous())
    for name, tensor in (extra or {}).items():
        writer.add(name, tensor.contiguous())
    writer.close()
    return tied and not keep_tied
