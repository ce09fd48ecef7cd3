"""Determinism: the same command on the same inputs writes the same bytes, in every file of the output
(weights, config.json with its record, model card, layer report, manifest; GGUF files and their
manifests whole), run twice and with 1 or 2 CPU threads (`torch.set_num_threads`). GPTQ and SparseGPT too:
their Hessian factor's diagonal blocks run on one thread (MKL's float32 Cholesky rounds differently with 1 and 2
threads; `compress.quantizers.hessian_factor`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from compress.export.gguf import ExportConfig, export_gguf
from compress.formats.gguf.plan import Target
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, REFERENCE_MODEL

CALIBRATION = {"path": str(CALIB_TEXT), "samples": 4, "seq_len": 128}
# (recipe, model, thread counts compared)
RECIPES = {
    "rtn": ({"stages": [{"method": "rtn", "bits": 4, "group_size": 128}]}, "reference", (1, 1, 2)),
    "wanda 2:4": ({"stages": [{"method": "wanda", "pattern": "2:4"}], "calibration": CALIBRATION}, "reference", (1, 1, 2)),
    "gptq": ({"stages": [{"method": "gptq", "bits": 4, "group_size": 32}], "calibration": CALIBRATION}, "reference", (1, 1, 2)),
    "sparsegpt 2:4": ({"stages": [{"method": "sparsegpt", "pattern": "2:4"}], "calibration": CALIBRATION}, "tiny", (2, 2, 1)),
}


def _files(path: Path) -> dict[str, bytes]:
    if path.is_file():  # a GGUF file and its manifest
        return {p.name: p.read_bytes() for p in (path, path.with_name(path.name + ".manifest.json"))}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _runs(make, out: Path, counts=(1, 1, 2)) -> list[dict[str, bytes]]:
    """``make(out)`` with each thread count in turn; each result read and removed, so every run writes the
    same path (the path is part of what is recorded)."""
    results, threads = [], torch.get_num_threads()
    try:
        for count in counts:
            torch.set_num_threads(count)
            make(out)
            results.append(_files(out))
            shutil.rmtree(out) if out.is_dir() else (out.unlink(), out.with_name(out.name + ".manifest.json").unlink())
    finally:
        torch.set_num_threads(threads)
    return results


def _differences(runs: list[dict[str, bytes]]) -> list[str]:
    first = runs[0]
    return [f"run {i + 1}: {name}" for i, run in enumerate(runs[1:], 1) for name in sorted(set(first) | set(run))
            if first.get(name) != run.get(name)]


@pytest.mark.parametrize("name", RECIPES)
def test_compression_writes_the_same_bytes(tmp_path, name, request):
    recipe, model, counts = RECIPES[name]
    model = REFERENCE_MODEL if model == "reference" else request.getfixturevalue("tiny_llama")

    def make(out: Path) -> None:
        run_recipe(parse_recipe({"model": str(model), **recipe, "output": {"path": str(out)}}), command="compress run r.yaml")

    runs = _runs(make, tmp_path / "out", counts)
    assert {"model.safetensors", "config.json", "README.md", "manifest.json", "compression_report.json"} <= set(runs[0])
    assert _differences(runs) == []


@pytest.mark.parametrize("target", [Target.q4_k_m, Target.q8_0])
def test_gguf_export_writes_the_same_bytes(tmp_path, target):
    runs = _runs(lambda out: export_gguf(ExportConfig(REFERENCE_MODEL, out, target, command="compress export")),
                           tmp_path / "model.gguf")
    assert set(runs[0]) == {"model.gguf", "model.gguf.manifest.json"}
    assert _differences(runs) == []
