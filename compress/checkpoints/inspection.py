"""What `compress inspect` reports about a checkpoint, as plain data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.errors import CompressError
from compress.checkpoints.packed import packed_summary
from compress.checkpoints.model_io import ModelHandle, get_weight, is_conv1d, open_model, parameter_count, quantizable_layers
from compress.pruners.masks import is_nm_sparse

NM_PATTERNS = ((2, 4), (4, 8))  # semi-structured patterns checked in every layer


def inspect_model(path: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """Architecture, decoder blocks, quantizable layers, size and recorded compression of a checkpoint.

    Reads config.json and tensor headers, and the quantizable layers' weights one at a time to
    measure their sparsity (see `measure_sparsity`).
    """
    handle = open_model(path, trust_remote_code)
    config = json.loads((path / "config.json").read_text())
    block_names = [handle.block_name(i) for i in range(len(handle.blocks))]
    layers = quantizable_layers(handle.model, block_names)
    everything = quantizable_layers(handle.model, block_names, include=[".*"])
    in_blocks = tuple(b + "." for b in block_names)
    block0 = handle.block_name(0) + "."
    per_block = [
        {"name": n.removeprefix(block0), "type": type(m).__name__, "shape": list(get_weight(m).shape)}
        for n, m in layers.items()
        if n.startswith(block0)
    ]
    return {
        "path": str(path),
        "architecture": type(handle.model).__name__,
        "model_type": config.get("model_type"),
        "decoder_blocks": {"path": handle.blocks_name, "count": len(handle.blocks), "class": type(handle.blocks[0]).__name__},
        "quantizable_layers": len(layers),
        "layers_per_block": per_block,
        "other_linear_layers": [
            {"name": n, "shape": list(get_weight(m).shape)} for n, m in everything.items() if not n.startswith(in_blocks)
        ],
        "parameters": parameter_count(handle.model, handle.tied_parameter_names()),
        "size_on_disk_bytes": handle.reader.total_bytes(),
        "weight_files": [f.name for f in handle.reader.files],
        "sparsity": measure_sparsity(handle, layers),
        "compression": config.get("compression"),
        "quantization_config": config.get("quantization_config"),
        "storage": packed_summary(handle, config, layers),
    }


def measure_sparsity(handle: ModelHandle, layers: dict) -> dict[str, Any]:
    """Fraction of exact zeros over ``layers``' weights, and whether every layer is N:M sparse.

    Each weight is read from the checkpoint on its own (one in memory at a time) and seen as
    ``[out, in]`` (layers without a dense ``.weight`` tensor are skipped: ``layers_measured`` counts the
    others); an N:M pattern holds when every group of M consecutive input columns of every
    layer has at most N non-zeros. ``pattern`` is the strictest one that holds (2:4 before 4:8), else None.
    """
    zeros = total = measured = 0
    holds = {f"{n}:{m}": True for n, m in NM_PATTERNS}
    for name, module in layers.items():
        try:
            weight = handle.reader.get(handle.checkpoint_key(name + ".weight"))
        except CompressError:  # no dense weight stored (e.g. a packed quantized format): not measurable
            continue
        measured += 1
        weight = weight.t() if is_conv1d(module) else weight
        zeros += int((weight == 0).sum())
        total += weight.numel()
        for n, m in NM_PATTERNS:
            holds[f"{n}:{m}"] = holds[f"{n}:{m}"] and is_nm_sparse(weight, n, m)
        del weight
    found = [p for p, ok in holds.items() if ok] if total else []
    return {
        "zeros": zeros / total if total else 0.0,
        "nm": holds if total else {p: False for p in holds},
        "pattern": found[0] if found else None,
        "layers_measured": measured,
    }
