"""The output directory: written under a temporary name and renamed only when complete.

A failed or interrupted run leaves no half-written output, an existing output is replaced only with
``overwrite`` and only once the new one is complete, and the input checkpoint is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from compress.errors import CompressError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
LAYER_REPORT = "compression_report.json"
NOT_COPIED = {"config.json", "README.md", "model.safetensors.index.json", "pytorch_model.bin.index.json", LAYER_REPORT}


def check_outside_input(output: Path, model: Path) -> None:
    """The output is neither the input model nor inside it (a symlink to either counts as it): the input
    is never touched."""
    out, src = output.resolve(), model.resolve()
    if out == src:
        raise CompressError(f"output {output} is the input model: choose another output directory")
    if src in out.parents:
        raise CompressError(f"output {output} is inside the input model {model}: choose a path outside it")


class OutputDir:
    """``with OutputDir(path, overwrite) as tmp:`` write into ``tmp``; renamed to ``path`` on success."""

    def __init__(self, final: Path, overwrite: bool = False, protect: Path | None = None):
        self.final = final
        self.overwrite = overwrite
        if protect is not None:
            check_outside_input(final, protect)
        if final.exists() and not overwrite:
            raise CompressError(f"output {final} already exists: pass --overwrite or choose another directory")
        if final.exists() and not final.is_dir():
            raise CompressError(f"output {final} is a file: choose a directory path")
        self.tmp = final.parent / f".{final.name}.partial-{os.getpid()}"

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation config and other small non-weight files of the checkpoint."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in NOT_COPIED and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def write_config(src: Path, dst: Path, record: dict[str, Any]) -> None:
    """The input's config.json plus a ``compression`` entry describing what was done."""
    config = json.loads((src / "config.json").read_text())
    history = config.get("compression", {}).get("history", [])
    if "compression" in config:
        history = history + [{k: v for k, v in config["compression"].items() if k != "history"}]
    config["compression"] = {**record, "history": history} if history else record
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_layer_report(dst: Path, layers: list) -> None:
    """Per-layer figures (shape, time, the method's error statistics) saved beside the weights."""
    from dataclasses import asdict

    rows = [asdict(r) for r in layers]
    (dst / LAYER_REPORT).write_text(json.dumps({"layers": rows}, indent=1) + "\n")


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_model_card(dst: Path, title: str, record: dict[str, Any], figures: dict[str, Any] | None = None) -> None:
    """The output's README.md: source, stages and settings, calibration, figures, the command."""
    stages = record.get("stages", [])
    lines = [
        f"# {title}",
        "",
        f"Compressed with llm-compress {record.get('tool_version', '')} from `{record.get('source_model', '')}`.",
        "",
        "| stage | method | settings |",
        "| --- | --- | --- |",
    ]
    for i, stage in enumerate(stages, 1):
        settings = ", ".join(f"{k}={v}" for k, v in stage.items() if k != "method")
        lines.append(f"| {i} | {stage.get('method', '')} | {settings} |")
    if record.get("calibration"):
        cal = record["calibration"]
        lines += ["", f"Calibration: {cal.get('samples')} samples × {cal.get('seq_len')} tokens from `{cal.get('path')}` (seed {cal.get('seed')})."]
    weights = sum(f.stat().st_size for f in dst.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    figures = {**(figures or {}), **({"weights on disk": f"{weights / 1e6:.2f} MB"} if weights else {})}
    if figures:
        lines += ["", "| figure | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in figures.items()]
    if record.get("command"):
        lines += ["", "Reproduce with:", "", "```", record["command"], "```"]
    if record.get("source_model"):  # the final path is the card's folder name beside the temporary one
        lines += [
            "", "Compare with other outputs of the same model (perplexity, KLD, size, bits per weight; one protocol):", "",
            "```", f"compress report {title} ... --baseline {record['source_model']} --text EVAL.txt", "```",
        ]
    if record.get("format") == "dense":
        lines += [
            "",
            "The weights are stored dense, in the checkpoint's original floating-point dtype, so any",
            "transformers-compatible loader reads them: quantized weights lie exactly on the recorded integer",
            "grid (fake-quantized), pruned weights are exact zeros.",
        ]
    elif record.get("format"):
        lines += [
            "",
            f"Quantized layers are stored packed in the {record['format']} layout described by `quantization_config`",
            "in config.json (other layers dense); `compress eval` and `compress inspect` read it directly.",
        ]
    lines.append("")
    (dst / "README.md").write_text("\n".join(lines))
