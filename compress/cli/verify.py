"""`compress verify`: an output against its manifest, every tensor re-read (packed ones decoded)."""

from __future__ import annotations

from pathlib import Path

import typer

from compress.cli.console import console, human_bytes, key_value_table, print_json, progress_bars, user_errors
from compress.cli.options import JSON_OPT, TRUST_REMOTE_CODE_OPT


def verify(
    output: Path = typer.Argument(..., help="Output directory, or GGUF file (its manifest is FILE.manifest.json)."),
    trust_remote_code: bool = TRUST_REMOTE_CODE_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Check an output's files against the SHA-256 digests of its manifest and re-read every tensor; the
    first damaged file (and tensor) is a one-line error with exit status 2."""
    from compress.checkpoints.integrity import verify as verify_output

    with progress_bars(not as_json) as progress:
        result = verify_output(output, trust_remote_code, progress)
    if as_json:
        print_json({"ok": True, **result.to_dict()})
        return
    rows = {
        "output": str(result.path),
        "files (SHA-256 as in the manifest)": result.files,
        "size": human_bytes(result.bytes),
        "tensors re-read": result.tensors,
        "packed layers decoded": result.packed_layers,
    }
    console.print(key_value_table("verified: intact", rows))


def register(app: typer.Typer) -> None:
    app.command("verify")(user_errors(verify))
