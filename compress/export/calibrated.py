"""Calibrated GGUF export: GPTQ solved in the GGML block grids, or AWQ scales, before the file is written.

The layer-by-layer engine runs the checkpoint on calibration windows, exactly as `compress quantize`
does, with one of the GGUF methods of `compress.engine.methods.gguf` given the type plan of the export
(`compress.formats.gguf.plan`: which GGML type each decoder-block linear layer gets):

- ``gptq``: every block-quantized layer is solved by GPTQ in its own type's grid, true-sequentially;
  its bytes go to the GGUF writer as they are, so the file holds the calibrated result rather than a
  re-rounding of it. The output layer (an untied ``lm_head``) is solved too, on the final norm of the
  quantized blocks' outputs (`compress.checkpoints.architecture.FINAL_NORMS`); the token embeddings, a lookup with
  no input statistics, get ggml's rounding, unless they are tied to the output layer: then their one tensor is
  solved as the output layer (``tied_output``) and the lookup reads GPTQ's rows.
- ``awq``: AWQ's scales are searched against each layer's GGML round trip and folded into the norms
  and linears; the scaled checkpoint is then written by ggml's rounding.
- ``awq-gptq``: both, as two engine stages per block: AWQ's scales, then GPTQ on the scaled layers.
- ``autoround``: each block's layers learn their rounding in their types' grids on the block's output
  (`compress.engine.methods.gguf_autoround`); their bytes go to the writer as GPTQ's do. The output layer and
  the token embeddings get ggml's rounding.

AWQ changes the weights, so its engine output is written to a scratch checkpoint next to the output
file and exported from there; GPTQ changes only the layers it encodes, so the rest is read from the
input checkpoint and nothing else is written. Either way the GGUF file appears only when complete.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from compress.checkpoints.architecture import FINAL_NORMS
from compress.checkpoints.calibration import load_calibration
from compress.checkpoints.shards import CheckpointReader, DiscardingWriter, ShardedWriter
from compress.engine.activations import scratch_beside
from compress.engine.block_engine import Engine, Stage
from compress.engine.ranks import Ranks
from compress.errors import CompressError
from compress.checkpoints.loading import ComputeDtype, load_tokenizer, model_dtype, resolve_compute_dtype, resolve_device
from compress.checkpoints.background import Background
from compress.export.gguf import (ExportConfig, ExportResult, GGUFMethod, check_importance, check_output, export_gguf,
                                  recorded_inputs)
from compress.export.gguf_tensors import tensor_plan
from compress.export.gguf_arch import read_config
from compress.formats.gguf.grids import is_block_quantized
from compress.formats.gguf.sizes import GGMLType
from compress.engine.methods.gguf import GGUFAWQ, GGUFGPTQ, GGUFAWQMethodConfig, GGUFGPTQMethodConfig, gguf_round_trip
from compress.engine.methods.gguf_autoround import GGUFAutoRound, GGUFAutoRoundMethodConfig
from compress.engine.methods.base import LayerReport
from compress.checkpoints.model_io import open_model, quantizable_layers
from compress.checkpoints.output import copy_side_files, write_config
from compress.checkpoints.calibration import CalibrationSpec
from compress.engine.statistics import InputStatistics, Stat

log = logging.getLogger(__name__)
ProgressFn = Callable[[str, int, int], None]


OUTPUT_LAYER = "lm_head"  # the llama-family output layer (GGUF output.weight)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # written as they are: nothing to solve


def solve_output_layer(handle, norm_name: str, hidden: list[torch.Tensor], solver: GGUFGPTQ, device, ranks: Ranks,
                       weight_of: str = OUTPUT_LAYER, reference: list[torch.Tensor] | None = None) -> list[LayerReport]:
    """GPTQ on the output layer, its Hessian from ``norm(hidden)`` (the final norm of the last block's
    outputs, of every process): the only layer outside the blocks with an input to calibrate on. Its weight
    is read as ``weight_of``'s (the input embeddings' when tied). ``reference``: the uncompressed model's last
    block outputs, for an asymmetric solver."""
    norm, layer = handle.model.get_submodule(norm_name), handle.model.get_submodule(OUTPUT_LAYER)
    handle.materialize(norm, norm_name, device, torch.float32)
    handle.materialize(layer, weight_of, device, torch.float32, only={"weight"})
    try:
        needs = solver.needs if reference is not None else solver.needs - {Stat.INPUT_DRIFT}
        stats = InputStatistics(layer.in_features, needs, device)
        with torch.inference_mode():
            for h, r in zip(hidden, reference or [None] * len(hidden)):
                stats.update(norm(h), norm(r) if r is not None else None)
        stats.combine(ranks)
        return solver.transform_block(layer, {OUTPUT_LAYER: layer}, {OUTPUT_LAYER: stats.result()}) if ranks.main else []
    finally:
        handle.release(norm)
        handle.release(layer, only={"weight"})


def _tied_embeddings(handle) -> str | None:
    """The input embeddings' module name when the output layer shares their weight (one GGUF tensor)."""
    if not handle.head_is_tied() or handle.module_name(handle.model.get_output_embeddings()) != OUTPUT_LAYER:
        return None
    return handle.module_name(handle.model.get_input_embeddings())


def _rounded_embeddings(handle, stored: dict[str, GGMLType]) -> dict[str, torch.Tensor]:
    """The input embeddings as the file will hold them (ggml's rounding in their type), by parameter name; empty
    when the file keeps them in a float type. Asymmetric calibration starts the compressed model's block inputs
    from these, so block 0's layers make up for the embeddings' rounding (a lookup: nothing else can)."""
    name = handle.module_name(handle.model.get_input_embeddings())
    kind = stored.get(handle.disk_name(f"{name}.weight").removesuffix(".weight")) if name is not None else None
    if kind is None:
        return {}
    weight = handle.reader.get(handle.checkpoint_key(f"{name}.weight")).float()
    return {f"{name}.weight": gguf_round_trip(kind)(weight)}


def layer_types(model: Path, config: ExportConfig) -> dict[str, GGMLType]:
    """Checkpoint (on-disk) linear layer name -> its GGML type, for the block-quantized weights of the export
    plan (each expert of a stacked MoE tensor too)."""
    plan = tensor_plan(CheckpointReader(model), read_config(model), config.target, config.has_imatrix, config.types)
    check_importance(plan, config)  # AWQ alone ends in ggml's plain rounding: refused here, before calibrating
    unsolvable = sorted({e.kind.name for e in plan if len(e.shape) >= 2 and not is_block_quantized(e.kind) and e.kind not in FLOAT_TYPES})
    if unsolvable:
        raise CompressError(f"GPTQ/AWQ in the {', '.join(unsolvable)} grid is not implemented: export that type with --method rtn or imatrix")
    return {
        name.removesuffix(".weight"): kind
        for sources, _, kind, shape in plan
        for name in sources
        if len(shape) >= 2 and name.endswith(".weight") and is_block_quantized(kind)
    }


def method_configs(method: GGUFMethod, options: dict) -> tuple[GGUFGPTQMethodConfig | None, GGUFAWQMethodConfig | None,
                                                             GGUFAutoRoundMethodConfig | None]:
    """The GPTQ, AWQ and AutoRound settings of a calibrated export from ``options`` (``-O KEY=VALUE``): each key goes to the
    method of ``method`` that has it (awq-gptq: to both where both have it); unknown or invalid ones are errors."""
    from pydantic import ValidationError

    configs = {cls: {} for solves, cls in ((method.solves, GGUFGPTQMethodConfig), (method.scales, GGUFAWQMethodConfig),
                                           (method.learns, GGUFAutoRoundMethodConfig)) if solves}
    for key, value in options.items():
        takers = [cls for cls in configs if key in cls.model_fields]
        if not takers:
            valid = sorted({f for cls in configs for f in cls.model_fields})
            raise CompressError(f"--method {method.value} has no setting {key!r}: use one of {', '.join(valid)}")
        for cls in takers:
            configs[cls][key] = value
    try:
        built = {cls: cls(**values) for cls, values in configs.items()}
    except ValidationError as exc:
        err = exc.errors()[0]
        raise CompressError(f"--method {method.value}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return built.get(GGUFGPTQMethodConfig), built.get(GGUFAWQMethodConfig), built.get(GGUFAutoRoundMethodConfig)


def export_calibrated(
    config: ExportConfig, method: GGUFMethod, calibration: CalibrationSpec, progress: ProgressFn | None = None,
    gptq: GGUFGPTQMethodConfig | None = None, awq: GGUFAWQMethodConfig | None = None, device: str = "cpu",
    compute_dtype: ComputeDtype = ComputeDtype.auto, autoround: GGUFAutoRoundMethodConfig | None = None,
    window_chunks: bool = False,
) -> ExportResult:
    """Calibrate ``config.model`` with ``method`` (gptq, awq or awq-gptq) on ``calibration`` (a recipe's
    calibration section) and write the GGUF file ``config.output``; the block forwards run in ``compute_dtype``
    (`resolve_compute_dtype`). ``window_chunks``: the engine's (`compress.engine.block_engine.Engine`), for a process
    whose allocator serves its chunks from the heap (`compress.cli.allocator.CALIBRATED_EXPORT`)."""
    start = time.perf_counter()
    if not method.calibrated:
        raise CompressError(f"--method {method.value} needs no calibration: use export_gguf")
    if config.imatrix is not None:
        raise CompressError(f"--imatrix is for --method imatrix, not {method.value}: drop it")
    read_config(config.model)  # a llama-family, unquantized checkpoint, or a clear error
    check_output(config)
    # GPTQ's grids fitted with the Hessian diagonal as importance count as an imatrix for llama.cpp's mixes
    config = replace(config, importance_fit=method.solves and (gptq is None or gptq.weighted_fit)
                     or method.learns and (autoround is None or autoround.weighted_fit))
    # recorded in the file: the AWQ path exports a scaled copy, so the source is named here
    config = replace(config, source=config.source or config.model, method=method.value, calibration=calibration.model_dump(mode="json"))
    # the record's digests on a core the imports leave idle, by the process that writes the file
    inputs = Background(lambda: recorded_inputs(config), "input digests") if Ranks.launched_main() else None
    handle = open_model(config.model)
    stored = layer_types(config.model, config)  # by on-disk name; the engine's layers by module name (Mixtral's differ)
    blocks = [handle.block_name(i) for i in range(len(handle.blocks))]
    disk = {n: handle.disk_name(f"{n}.weight").removesuffix(".weight") for n in quantizable_layers(handle.model, blocks)}
    layers = {n: m for n, m in quantizable_layers(handle.model, blocks).items() if disk[n] in stored}
    types = {n: stored[disk[n]] for n in layers} | {n: k for n, k in stored.items() if n == OUTPUT_LAYER}
    embed = _tied_embeddings(handle) if method.solves and (gptq is None or gptq.tied_output) else None
    embed_disk = handle.disk_name(f"{embed}.weight").removesuffix(".weight") if embed is not None else None
    if embed_disk in stored:  # the output layer is the embeddings: one GGUF tensor, solved as the output layer
        types[OUTPUT_LAYER], disk[OUTPUT_LAYER] = stored[embed_disk], embed_disk  # its bytes are token_embd's
    else:
        embed = None
    device = resolve_device(device)
    head, solver, stages = None, None, []
    if method.scales:
        stages.append(Stage(GGUFAWQ(awq or GGUFAWQMethodConfig(), types), layers))
    learner = GGUFAutoRound(autoround or GGUFAutoRoundMethodConfig(), types) if method.learns else None
    if learner is not None:
        stages.append(Stage(learner, layers))
    if method.solves:
        solver = GGUFGPTQ(gptq or GGUFGPTQMethodConfig(), types)
        stages.append(Stage(solver, layers))
        if solver.config.output_layer and OUTPUT_LAYER in types and handle.config.model_type in FINAL_NORMS:
            head = FINAL_NORMS[handle.config.model_type]
    ranks = Ranks.from_environment(device)  # under a launcher: data-parallel calibration, weight-parallel solves
    asymmetric = solver is not None and solver.config.asymmetric
    dtype, _ = resolve_compute_dtype(compute_dtype, model_dtype(handle.config), device)
    engine = Engine(handle, stages, device, dtype, batch_size=calibration.batch_size, progress=progress, keep_final_hidden=head is not None,
                    ranks=ranks, activation_memory=calibration.activation_memory, scratch=scratch_beside(config.output),
                    outer_weights=_rounded_embeddings(handle, stored) if asymmetric and embed is None else None,
                    window_chunks=window_chunks)
    engine.check_stages()  # before the calibration set is tokenized
    windows = load_calibration(
        calibration.path, load_tokenizer(config.model), calibration.samples, calibration.seq_len, calibration.seed
    )
    engine.check_calibration(windows)

    def run_engine(writer):
        with ranks:
            run = engine.run(writer, windows)
            if head is not None:
                run.layers += solve_output_layer(handle, head, run.final_hidden, solver, device, ranks, embed or OUTPUT_LAYER,
                                                 run.final_reference)
        return run

    def encoded_by_disk_name():  # GPTQ's bytes, under the names the writer reads the checkpoint by
        encoder = solver or learner
        return {disk.get(n, n): v for n, v in encoder.encoded.items()} if encoder is not None else None

    if not ranks.main:  # its share of the calibration and solves; the main process writes the file
        run_engine(DiscardingWriter())
        return ExportResult(config.output, config.target.value, handle.config.model_type, seconds=time.perf_counter() - start)
    if not method.scales:  # only the encoded layers change: read the rest from the input
        run = run_engine(DiscardingWriter())  # GPTQ's product is its encoded bytes
        result = export_gguf(config, progress, encoded=encoded_by_disk_name(), inputs=inputs, model_checked=True)
    else:  # the scaled checkpoint, written next to the output and exported from there
        config.output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=config.output.parent, prefix=f".{config.output.name}.awq-{os.getpid()}-") as scratch:
            writer = ShardedWriter(Path(scratch))
            run = run_engine(writer)
            writer.close()
            copy_side_files(config.model, Path(scratch))
            write_config(config.model, Path(scratch), {"stages": [stage.method.record() for stage in stages]})
            result = export_gguf(replace(config, model=Path(scratch)), progress, encoded=encoded_by_disk_name(), inputs=inputs)
    result.notes.append(f"calibrated with {method.value} on {calibration.samples} x {calibration.seq_len} tokens of {calibration.path.name}")
    gains = [np.log(r.info["rtn_rel_error"] / r.info["rel_error"]) for r in run.layers if r.info.get("rel_error") and "rtn_rel_error" in r.info]
    if gains:
        result.notes.append(f"GPTQ: layer output error {np.exp(np.mean(gains)):.2f}x below ggml's rounding (geometric mean)")
    result.seconds = time.perf_counter() - start  # calibration included
    return result
