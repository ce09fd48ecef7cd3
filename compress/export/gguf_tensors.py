"""The tensors of a GGUF export, planned before any is written: each GGUF tensor's checkpoint sources (an MoE role's
experts stacked in order), name, GGML type (`compress.formats.gguf.plan.tensor_type` for the target, or a per-tensor
plan's) and shape, in llama.cpp's order. The export (`compress.export.gguf`), its calibrated variant
(`compress.export.calibrated`), its size estimate (`compress.export.sizing`) and allocation plans read the same plan.
"""

from __future__ import annotations

import logging
from typing import Mapping, NamedTuple

from compress.checkpoints.shards import CheckpointReader
from compress.errors import CompressError
from compress.export.gguf_arch import ARCHITECTURES, TRANSPOSED_ARCHS, expert_count
from compress.formats.gguf import plan
from compress.formats.gguf.plan import Target
from compress.formats.gguf.sizes import GGMLType

log = logging.getLogger(__name__)


def stored_shape(reader: CheckpointReader, name: str) -> list[int]:
    # safetensors headers give shapes without reading data; other formats read the tensor
    entry = getattr(reader, "_entries", {}).get(name)
    return list(entry[1]["shape"]) if entry else list(reader.get(name).shape)


def is_transposed(arch: str, gname: str, shape: list[int]) -> bool:
    """Stored ``[in, out]`` (GPT-2's Conv1D): written transposed, one GGUF row per output."""
    return arch in TRANSPOSED_ARCHS and gname.startswith("blk.") and len(shape) == 2


def gqa(config: dict) -> int:
    """Query heads per key/value head (llama.cpp's ``n_gqa``, which some of its type rules read)."""
    heads = config["num_attention_heads"]
    return heads // (config.get("num_key_value_heads") or heads)


class PlannedTensor(NamedTuple):
    """One GGUF tensor to write: its checkpoint tensors (an MoE role's experts, stacked in order), name, type and
    torch shape as written (``[n_expert, out, in]`` for stacked experts)."""

    sources: tuple[str, ...]
    gguf: str
    kind: GGMLType
    shape: list[int]


def tensor_plan(
    reader: CheckpointReader, config: dict, target: Target, has_imatrix: bool = False, types: Mapping[str, GGMLType] | None = None,
) -> list[PlannedTensor]:
    """Every tensor to write, in llama.cpp's order; ``types`` (GGUF name -> type, already fitted to the row
    length) overrides ``target``'s choice per tensor."""
    shapes: dict[str, tuple[list[str], list[int]]] = {}  # gguf name -> (checkpoint names, shape of one)
    arch = ARCHITECTURES[config["model_type"]]
    for name in reader.names():
        gname = plan.gguf_name(name, arch)
        if gname is None:
            if not name.endswith(("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")):  # buffers
                log.warning("tensor %s has no GGUF counterpart; skipped", name)
            continue
        shape = stored_shape(reader, name)
        sources, first = shapes.setdefault(gname, ([], shape[::-1] if is_transposed(arch, gname, shape) else shape))
        if sources and (plan.expert_index(name) is None or shape != first):
            raise CompressError(f"{name} and {sources[0]} both map to GGUF tensor {gname}: the checkpoint does not match its config.json")
        sources.append(name)
    if "output.weight" in shapes and config.get("tie_word_embeddings", False):
        del shapes["output.weight"]
    tied = "output.weight" not in shapes
    n_layers, n_expert = config["num_hidden_layers"], expert_count(config)
    entries = []
    for gname, (sources, shape) in shapes.items():
        if plan.expert_index(sources[0]) is not None:  # stacked by expert index: every one present once
            sources = sorted(sources, key=plan.expert_index)
            if [plan.expert_index(n) for n in sources] != list(range(n_expert)):
                raise CompressError(f"{gname}: the checkpoint has experts {[plan.expert_index(n) for n in sources]}, config.json says {n_expert}")
            shape = [n_expert, *shape]
        kind = plan.tensor_type(target, gname, tuple(shape), n_layers, tied, n_gqa=gqa(config), has_imatrix=has_imatrix,
                                n_expert=n_expert)
        if types and gname in types:
            kind = types[gname]
        entries.append(PlannedTensor(tuple(sources), gname, kind, shape))

    def order(entry):
        g = entry.gguf
        if g.startswith("blk."):
            return (1, int(g.split(".")[1]), g)
        return (0 if g.startswith("token_embd") else 2, 0, g)

    return sorted(entries, key=order)
