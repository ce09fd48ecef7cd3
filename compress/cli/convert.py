"""`compress convert`: a GGUF file into an ordinary safetensors checkpoint (config, tokenizer, float weights)."""

from __future__ import annotations

from pathlib import Path

import typer

from compress.cli.console import console, human_bytes, key_value_table, print_json, progress_bars, user_errors
from compress.cli.options import JSON_OPT, OVERWRITE_OPT


def convert(
    model: Path = typer.Argument(..., help="GGUF file (llama.cpp's format) of a model transformers can convert."),
    output: Path = typer.Option(..., "-o", "--output", help="Output checkpoint directory (written atomically)."),
    dtype: str = typer.Option("float32", "--dtype", help="Weight dtype of the output: float32, bfloat16 or float16."),
    overwrite: bool = OVERWRITE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Convert a GGUF file into a safetensors checkpoint with its tokenizer (streamed tensor by tensor)."""
    from compress.checkpoints.gguf_source import ConvertDtype, convert_gguf
    from compress.errors import CompressError

    try:
        kind = ConvertDtype(dtype.lower())
    except ValueError:
        raise CompressError(f"unknown --dtype {dtype!r}: use {', '.join(d.value for d in ConvertDtype)}") from None
    with progress_bars(not as_json) as progress:
        result = convert_gguf(model, output, kind, overwrite, progress)
    if as_json:
        print_json(result.to_dict())
        return
    rows = {
        "output": str(result.output),
        "architecture": result.architecture,
        "tensors written": result.tensors,
        "parameters": f"{result.parameters:,}",
        "source tensor types": ", ".join(f"{n} {k}" for k, n in sorted(result.source_types.items())),
        "dtype": kind.value,
        "output size": human_bytes(result.output_bytes),
        "time": f"{result.seconds:.1f} s",
    }
    console.print(key_value_table("GGUF conversion", rows))


def register(app: typer.Typer) -> None:
    app.command("convert")(user_errors(convert))
