"""`compress measure`: per-layer sensitivity of a checkpoint to each candidate scheme, kept in a JSON file.

The file is keyed by layer and candidate (`compress.run.plan`). A rerun with the same model, calibration,
layer selection and solver settings measures only the candidates the file lacks and adds them; other
settings are a one-line error (or start afresh with ``overwrite``). The candidates are measured in one pass over
the blocks and written when it ends: an interrupted run keeps what earlier runs wrote and loses its own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from compress import __version__
from compress.checkpoints.calibration import CalibrationSpec, load_calibration
from compress.checkpoints.loading import load_tokenizer, resolve_device
from compress.checkpoints.model_io import get_weight, open_model, quantizable_layers
from compress.engine.sensitivity import SolverSettings, measure_sensitivity
from compress.errors import CompressError
from compress.formats.candidates import parse_candidates
from compress.run.plan import SENSITIVITY_FORMAT, Sensitivity, load_sensitivity, write_json

log = logging.getLogger(__name__)


@dataclass
class MeasureResult:
    sensitivity: Sensitivity
    measured: list[str] = field(default_factory=list)  # candidates measured by this run
    reused: list[str] = field(default_factory=list)  # candidates found in the file
    seconds: float = 0.0


def selected_layers(handle, gguf: bool, include: list[str] | None, exclude: list[str] | None) -> dict[str, nn.Module]:
    """The layers to measure: block linears (with ``include``/``exclude`` as `compress quantize`), and for GGUF
    candidates also the input embeddings and an untied output layer (the tensors a GGUF file quantizes)."""
    blocks = [handle.block_name(i) for i in range(len(handle.blocks))]
    layers = quantizable_layers(handle.model, blocks, include, exclude)
    if gguf and not include:
        model = handle.model
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = handle.head_is_tied()
        for name, module in model.named_modules():
            if module is embed or (module is head and not tied):
                layers[name] = module
        layers = {n: m for n, m in layers.items() if not any(re.search(p, n) for p in exclude or [])}
    return layers


def _setup(model: Path, calibration: CalibrationSpec, settings: SolverSettings, layers: dict[str, nn.Module]) -> dict[str, Any]:
    """What must match for measurements to be reused."""
    return {
        "model": str(model),
        "calibration": calibration.model_dump(mode="json", exclude={"batch_size"}),
        "settings": {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(settings).items()},
        "layer_names": sorted(layers),
    }


def run_measure(
    model: Path,
    calibration: CalibrationSpec,
    candidates: str | list[str],
    output: Path,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    settings: SolverSettings = SolverSettings(),
    device: str = "cpu",
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    on_layer=None,
    source: str | None = None,
) -> MeasureResult:
    """Measure ``candidates`` on ``model`` into ``output`` (reusing what it holds); ``source``: the model as the
    user named it (a GGUF file converted into ``model``)."""
    wanted = parse_candidates(candidates)
    handle = open_model(model)
    if getattr(handle.config, "quantization_config", None):
        raise CompressError(f"{model} is already quantized (quantization_config): measure the original checkpoint")
    gguf = wanted[0].is_gguf
    layers = selected_layers(handle, gguf, include, exclude)
    if not layers:
        raise CompressError("no layers selected: check --include/--exclude")
    setup = _setup(Path(source) if source else model, calibration, settings, layers)
    data: dict[str, Any] | None = None
    if output.exists() and not overwrite:
        existing = load_sensitivity(output)
        mismatch = [k for k in setup if existing.data.get("setup", {}).get(k) != setup[k]]
        if mismatch:
            raise CompressError(
                f"{output} was measured with another {mismatch[0].replace('_', ' ')}: use another -o, or --overwrite to start afresh"
            )
        if existing.candidates and parse_candidates(existing.candidates)[0].is_gguf != gguf:
            raise CompressError(f"{output} holds {'GGUF types' if not gguf else 'integer grids'}: measure the other family into another file")
        data = existing.data
    if data is None:
        shapes = {n: list(get_weight(m).shape) for n, m in layers.items()}
        data = {"format": SENSITIVITY_FORMAT, "tool_version": __version__, "setup": setup,
                "layers": {n: {"shape": shapes[n], "candidates": {}} for n in layers}, "uniform_kld": {}}
    reused = [c.name for c in wanted if c.name in data["uniform_kld"]]
    todo = [c for c in wanted if c.name not in data["uniform_kld"]]
    if not todo:
        return MeasureResult(Sensitivity(data, output), [], reused)
    device_ = resolve_device(device)
    windows = load_calibration(calibration.path, load_tokenizer(model), calibration.samples, calibration.seq_len, calibration.seed)
    scale_bytes = _weight_itemsize(handle, next(iter(layers)))
    run = measure_sensitivity(handle, windows, todo, layers, settings, device_, calibration.batch_size, progress, on_layer, scale_bytes)
    for name, by_candidate in run.layers.items():
        for c, measured in by_candidate.items():
            data["layers"][name]["candidates"][c] = {k: v for k, v in dataclasses.asdict(measured).items() if v is not None}
    data["uniform_kld"].update(run.uniform_kld)
    data["calibration_tokens"] = run.tokens
    data["updated"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    write_json(output, data)
    return MeasureResult(Sensitivity(data, output), [c.name for c in todo], reused, run.seconds)


def _weight_itemsize(handle, layer: str) -> int:
    """Bytes of one value of the checkpoint's weights (compressed-tensors stores its scales in that dtype)."""
    return handle.reader.get(handle.checkpoint_key(f"{layer}.weight")).element_size() if layer else torch.float32.itemsize
