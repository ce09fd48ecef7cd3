"""`compress inspect` and `compress methods`: what a checkpoint holds, and the registered methods."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from compress.cli.console import human_bytes, key_value_table, print_json, stdout, user_errors
from compress.cli.options import JSON_OPT


@user_errors
def inspect(
    model: Path = typer.Argument(..., help="Checkpoint directory."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the checkpoint's own model code (config auto_map)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Architecture, decoder blocks, quantizable layers, size, and compression already present."""
    from compress.checkpoints.inspection import inspect_model

    info = inspect_model(model, trust_remote_code)
    if as_json:
        print_json(info)
        return
    blocks = info["decoder_blocks"]
    stdout.print(
        key_value_table(
            str(model),
            {
                "architecture": f"{info['architecture']} ({info['model_type']})",
                "decoder blocks": f"{blocks['count']} × {blocks['class']} at {blocks['path']}",
                "quantizable layers": info["quantizable_layers"],
                "parameters": f"{info['parameters']:,}",
                "size on disk": human_bytes(info["size_on_disk_bytes"]),
                "weight files": ", ".join(info["weight_files"]),
                "sparsity": _describe_sparsity(info["sparsity"]),
                "compression": _describe_compression(info),
                "format": info["storage"]["format"],
                "bits per weight": _describe_bits(info["storage"]),
            },
        )
    )
    table = Table(title=f"linear layers in each of the {blocks['count']} blocks", title_justify="left")
    for col in ("layer", "type", "out × in"):
        table.add_column(col)
    for layer in info["layers_per_block"]:
        table.add_row(layer["name"], layer["type"], " × ".join(map(str, layer["shape"])))
    for layer in info["other_linear_layers"]:
        table.add_row(f"{layer['name']} (outside blocks, not compressed by default)", "", " × ".join(map(str, layer["shape"])))
    stdout.print(table)


def _describe_sparsity(sparsity: dict[str, Any]) -> str:
    if not sparsity["layers_measured"]:
        return "not measurable (no dense weights stored)"
    pattern = sparsity["pattern"]
    nm = f"{pattern} in every group of {pattern.split(':')[1]}" if pattern else "no N:M pattern"
    return f"{sparsity['zeros']:.2%} zeros in the block linear layers; {nm}"


def _describe_bits(storage: dict[str, Any]) -> str:
    """On-disk bits per weight of the block linear layers (codes + scales + zeros + indices)."""
    if storage["bits_per_weight"] is None:
        return "n/a"
    text = f"{storage['bits_per_weight']:.3f} in the block linear layers"
    if storage["packed_layers"]:
        text += f" ({storage['packed_layers']} packed: {storage['packed_bits_per_weight']:.3f})"
    return text


def _describe_compression(info: dict[str, Any]) -> str:
    record, qc = info.get("compression"), info.get("quantization_config")
    if record:
        stages = "; ".join(
            " ".join(f"{k}={v}" for k, v in s.items() if k not in ("include", "exclude") and v is not None)
            for s in record.get("stages", [])
        )
        return f"{record.get('format', '')} by {record.get('tool', '?')} {record.get('tool_version', '')}: {stages}"
    if qc:
        return f"quantization_config: {qc.get('quant_method', '?')}"
    return "none recorded"


def _typed(value) -> object:
    """A default as the user types it with -O (an enum's value, not its repr)."""
    return value.value if isinstance(value, enum.Enum) else value


def _default(field) -> object:
    """A setting's default as typed with -O: a list's items joined by commas, a required one marked so."""
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(_typed(v)) for v in value) + "]"
    return _typed(value)


def methods() -> None:
    """List the registered methods and their settings."""
    from compress.engine.registry import method_class, method_names

    table = Table(title="methods", title_justify="left")
    table.add_column("method")
    table.add_column("settings (default)")
    for name in method_names():
        cfg = method_class(name).Config
        table.add_row(name, ", ".join(f"{k}={_default(f)}" for k, f in cfg.model_fields.items()))
    stdout.print(table)


def register(app: typer.Typer) -> None:
    """Add these commands to the CLI."""
    app.command()(inspect)
    app.command()(methods)
