"""What `compress inspect` reports about a checkpoint, as plain data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.model_io import get_weight, open_model, parameter_count, quantizable_layers


def inspect_model(path: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    """Architecture, decoder blocks, quantizable layers, size and recorded compression of a checkpoint.

    Reads config.json and tensor headers only: no weight is loaded.
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
        "parameters": parameter_count(handle.model),
        "size_on_disk_bytes": handle.reader.total_bytes(),
        "weight_files": [f.name for f in handle.reader.files],
        "compression": config.get("compression"),
        "quantization_config": config.get("quantization_config"),
    }
