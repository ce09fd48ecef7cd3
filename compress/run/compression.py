"""A recipe's compression stages on the engine: the output checkpoint, its record, evaluation and export."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress import __version__
from compress.checkpoints.calibration import load_calibration
from compress.checkpoints.conversion import RenamingWriter
from compress.checkpoints.experts import expert_layers
from compress.checkpoints.shards import DiscardingWriter, ShardedWriter
from compress.checkpoints.transforms import only_transforms, transform_config, transform_keys, with_transforms
from compress.engine.activations import scratch_beside
from compress.engine.block_engine import Engine, EngineResult, LayerFn, ProgressFn, Stage
from compress.engine.journal import BlockJournal, check_resumable, fingerprint
from compress.engine.ranks import Ranks
from compress.checkpoints.background import Background
from compress.eval.perplexity import EvalResult
from compress.errors import CompressError
from compress.checkpoints.loading import load_tokenizer, model_dtype, resolve_compute_dtype, resolve_device
from compress.eval.checkpoint import evaluate_checkpoint
from compress.formats.packers import make_format
from compress.checkpoints.model_io import get_weight, open_model, quantizable_layers
from compress.checkpoints.output import OutputDir, copy_side_files, dir_size, run_inputs, write_config, write_layer_report, write_model_card
from compress.run.kv_cache import kv_observer, store_kv_scales, with_kv_cache_scheme
from compress.run.plan import apply_plans
from compress.run.recipe import Recipe, StageSpec
from compress.run.reshape import check_reshaping_stages, run_reshaping

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output: Path
    engine: EngineResult
    input_bytes: int
    output_bytes: int
    evaluation: EvalResult | None = None
    notes: list[str] = field(default_factory=list)  # choices the run made for the user (e.g. group size auto)
    plans: list[dict[str, Any]] = field(default_factory=list)  # per-layer plans the stages ran (with predicted KLD)

    def to_dict(self) -> dict[str, Any]:
        layers = [asdict(r) for r in self.engine.layers]
        return {
            "output": str(self.output),
            "layers": layers,
            "blocks": self.engine.blocks,
            "seconds": round(self.engine.seconds, 3),
            "peak_rss_bytes": self.engine.peak_rss_bytes,
            "peak_device_bytes": self.engine.peak_device_bytes,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "evaluation": self.evaluation.to_dict() if self.evaluation else None,
            "notes": self.notes,
            "plans": self.plans,
        }


AUTO_GROUP_SIZES = (128, 64, 32)


def resolve_auto_group_sizes(recipe: Recipe, handle) -> tuple[Recipe, list[str]]:
    """Each stage's ``group_size: auto`` as the largest of 128, 64, 32 that divides the in_features of every
    layer the stage selects (a width such as SmolLM2's 576 takes 64); with a note saying which."""
    block_names = [handle.block_name(i) for i in range(len(handle.blocks))]
    stages, notes = [], []
    for index, spec in enumerate(recipe.stages):
        if not spec.build().config.wants_auto_group_size():
            stages.append(spec)
            continue
        layers = quantizable_layers(handle.model, block_names, spec.include, spec.exclude)
        widths = sorted({get_weight(module).shape[1] for module in layers.values()})
        chosen = next((size for size in AUTO_GROUP_SIZES if all(w % size == 0 for w in widths)), None)
        if chosen is None:
            raise CompressError(
                f"stage {index + 1} ({spec.method}): group size auto: none of {', '.join(map(str, AUTO_GROUP_SIZES))} divides "
                f"every selected layer's in_features ({', '.join(map(str, widths))}): give -1 (per channel) or exclude those layers"
            )
        notes.append(f"stage {index + 1} ({spec.method}): group size auto chose {chosen} (in_features {', '.join(map(str, widths))})")
        stages.append(StageSpec.model_validate({**spec.model_dump(), "group_size": chosen}))
    return recipe.model_copy(update={"stages": stages}), notes


def _inputs(recipe: Recipe) -> dict[str, dict]:
    cal = recipe.calibration
    return run_inputs(recipe.source_model, calibration=cal and cal.path, evaluation=recipe.evaluation and recipe.evaluation.text)


def _record(recipe: Recipe, command: str | None, methods: list, inputs: dict[str, dict] | None = None) -> dict[str, Any]:
    """``methods``: the instances that ran (their records may hold what they learned, e.g. input scales);
    ``inputs``: the digests of the run's inputs, when already computed."""
    stages = []
    for spec, method in zip(recipe.stages, methods):
        entry = method.record()
        if spec.include:
            entry["include"] = spec.include
        if spec.exclude:
            entry["exclude"] = spec.exclude
        stages.append(entry)
    cal = recipe.calibration
    return {
        "tool": "llm-compress",
        "tool_version": __version__,
        "source_model": str(recipe.source_model),
        "format": "dense",  # replaced by the packed format's name when any layer is stored packed
        "stages": stages,
        "calibration": cal.model_dump(mode="json") if cal else None,
        "inputs": inputs if inputs is not None else _inputs(recipe),
        **({"command": command} if command else {}),
    }  # no clock time: the same command on the same inputs writes the same bytes


def _settings(recipe: Recipe) -> dict[str, Any]:
    """The recipe's settings a resumed run must share with the killed one (all but resuming and overwriting)."""
    settings = recipe.model_dump(mode="json", exclude={"resume": True, "output": {"overwrite"}})
    settings["model"] = str(recipe.source_model)  # a GGUF model is converted into a new scratch folder each run
    return settings


def _dense_linears(handle, packed) -> list[str]:
    """Every Linear layer of the model not stored packed (loaders must leave them dense), by its on-disk name
    (vLLM's) and, where transformers renames it (GPT-NeoX's ``embed_out`` is its ``lm_head``), its model name."""
    from torch import nn

    names = [n for n, m in handle.model.named_modules() if isinstance(m, nn.Linear) and n not in packed]
    return sorted({handle.names.disk_module(n) if handle.names else n for n in names} | set(names))


def check_expert_packing(experts: list[str], stages: list[Stage], packing: bool) -> None:
    """A packed output of an MoE model must pack every expert as weight-only symmetric integer codes: that is all
    transformers' compressed-tensors loader dequantizes into its fused experts (it fails on dense, W8A8 int8 or
    asymmetric experts). Checked before any work."""
    if not packing or not experts:
        return
    quantizing = [s for s in stages if s.method.record().get("bits") is not None or s.method.record().get("activations")]
    if not quantizing:
        return  # pruning only: a dense output, which transformers loads
    for stage in quantizing:
        record, selected = stage.method.record(), [n for n in experts if n in stage.layers]
        problem = "int8 W8A8 (int-quantized)" if record.get("activations") else (
            "asymmetric" if record.get("symmetric") is False else None)
        if selected and problem:
            raise CompressError(
                f"{stage.method.name}: MoE expert layers such as {selected[0]} would be stored {problem}, which transformers' "
                "compressed-tensors loader cannot read into its fused experts (it dequantizes weight-only symmetric ones): "
                "write --format fake, or exclude the experts with --exclude experts and quantize them in a weight-only stage"
            )
    covered = set().union(*(stage.layers for stage in quantizing))
    dense = [n for n in experts if n not in covered]
    if dense:
        raise CompressError(
            f"MoE expert layers such as {dense[0]} are left dense beside packed layers, which transformers' compressed-tensors "
            "loader cannot read (it dequantizes only packed experts): quantize every expert, or write --format fake"
        )


def _packed_on_disk(handle, packed: dict) -> dict:
    """The packed layers by on-disk name, as the checkpoint stores them (per-expert names for MoE experts)."""
    return {handle.names.disk_module(n) if handle.names else n: layer for n, layer in packed.items()}


def _write_quantization_config(directory: Path, quantization_config: dict[str, Any], dtype: torch.dtype | None) -> None:
    """config.json's ``quantization_config``, and the ``dtype`` its loaders compute in where the format needs one (a
    consumer loading with ``dtype="auto"`` takes it)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config.update({key: name for key in ("dtype", "torch_dtype") if key in config} or {"dtype": name})
    path.write_text(json.dumps(config, indent=2) + "\n")


def run_stages(
    recipe: Recipe, progress: ProgressFn | None = None, command: str | None = None, on_layer: LayerFn | None = None,
    window_chunks: bool = False,
) -> RunResult:
    """Compress ``recipe.model`` by its stages and write ``recipe.output.path`` atomically (then evaluate
    and export it, as the recipe says). ``window_chunks``: the engine's (`compress.engine.block_engine.Engine`)."""
    reshaping = check_reshaping_stages(recipe, recipe.methods())
    if reshaping is not None:  # structured pruning: a new checkpoint of other shapes, not the block engine
        if recipe.resume:
            raise CompressError("--resume: structured pruning records no progress to resume: run without --resume")
        engine, input_bytes, evaluation, notes = run_reshaping(recipe, reshaping, _record(recipe, command, [reshaping]), progress)
        return RunResult(recipe.output.path, engine, input_bytes, dir_size(recipe.output.path), evaluation, notes)
    digests = Background(lambda: _inputs(recipe), "input digests")  # while the model's code is imported
    device = resolve_device(recipe.device.value)
    handle = open_model(recipe.model, recipe.trust_remote_code)
    quantized = getattr(handle.config, "quantization_config", None)
    if quantized and not only_transforms(quantized):
        raise CompressError(f"{recipe.model} is already quantized (quantization_config in config.json): compress the original checkpoint")
    source_config = json.loads((recipe.model / "config.json").read_text())
    transforms = transform_config(source_config)  # online rotations: applied on the engine's forwards, carried over
    recipe, notes = resolve_auto_group_sizes(recipe, handle)
    packer = make_format(recipe.output.format)
    if transforms is not None and packer is not None and packer.name != "compressed-tensors":
        raise CompressError(f"{recipe.model} records online rotations (transform_config), which only compressed-tensors loaders "
                            f"apply: write --format compressed-tensors or fake, not {packer.name}")
    if packer is not None:
        for method in recipe.methods():
            packer.check_stage(method.record())
    output = OutputDir(recipe.output.path, recipe.output.overwrite, protect=recipe.model)
    block_names = [handle.block_name(i) for i in range(len(handle.blocks))]
    stages = [
        Stage(method, quantizable_layers(handle.model, block_names, spec.include, spec.exclude))
        for spec, method in zip(recipe.stages, recipe.methods())
    ]
    check_expert_packing(expert_layers(handle.model), stages, packer is not None)
    plans = apply_plans(recipe.stages, stages, handle)  # per-layer settings: stages[i].overrides
    cal = recipe.calibration
    observer = kv_observer(recipe)  # calibrated KV-cache scales, collected on the engine's block runs
    ranks = Ranks.from_environment(device)  # under torchrun / accelerate launch: this process's part of the run
    dtype, why = resolve_compute_dtype(recipe.compute_dtype, model_dtype(handle.config), device)
    if dtype != torch.float32 or why != "the checkpoint's":
        notes.append(f"forward passes in {str(dtype).removeprefix('torch.')} ({why})")
    engine = Engine(
        handle, stages, device, dtype, batch_size=cal.batch_size if cal else 8, progress=progress, on_layer=on_layer, packer=packer,
        observer=observer, all_experts=cal.all_experts if cal else True, ranks=ranks,
        activation_memory=cal.activation_memory if cal else None, scratch=scratch_beside(recipe.output.path),
        window_chunks=window_chunks,
    )
    engine.check_stages()  # a layer the method cannot take fails before the calibration set is tokenized
    calibration = None
    if cal is not None:  # loaded even when unused, so a bad calibration set fails early and clearly
        calibration = load_calibration(cal.path, load_tokenizer(recipe.model), cal.samples, cal.seq_len, cal.seed)
        if not engine.needs_data:
            log.warning("no method in this recipe uses calibration data; it was checked but is unused")
    engine.check_calibration(calibration)
    # a plan file's layers, not only its path; the processes, each of which recorded its share of the inputs
    settings = {**_settings(recipe), "plans": [plan.to_dict() for _, plan in plans], "processes": ranks.world}
    # taken when first needed (a resumed run's check, the first progress record once the digests are done, the run's
    # record), so hashing a large model's files goes on during the first blocks rather than before them
    current = functools.cache(lambda: fingerprint(settings, digests.result()["model"], calibration))
    if recipe.resume:
        output.resume = lambda directory: check_resumable(directory, current())
    if not ranks.main:  # its share of the calibration and of the solves; the main rank writes, evaluates, exports
        with ranks:
            tmp = ranks.broadcast_object(None)  # the main rank's temporary directory, where each rank records its progress
            result = engine.run(DiscardingWriter(), calibration, BlockJournal(tmp, current))
        return RunResult(recipe.output.path, result, handle.reader.total_bytes(), 0, None, notes)

    with output as tmp:
        writer = ShardedWriter(tmp, recipe.output.shard_size_mb << 20)
        if handle.names is not None:  # tensors under the checkpoint's on-disk names (transformers' layout)
            writer = RenamingWriter(writer, handle.names)
        journal = BlockJournal(tmp, current, digests.done)  # progress after each block, for --resume
        with ranks:  # the process group ends with the engine's run: writing, evaluating and exporting are the main rank's
            ranks.broadcast_object(tmp)
            result = engine.run(writer, calibration, journal)
        journal.remove()
        kv_scheme = store_kv_scales(observer, writer, handle.config)
        for key in transform_keys(source_config, handle.reader.names()):
            writer.add(key, handle.reader.get(key))
        writer.close()
        copy_side_files(recipe.model, tmp)
        write_layer_report(tmp, result.layers)
        record = _record(recipe, command, [stage.method for stage in stages], digests.result())
        for index, plan in plans:
            record["stages"][index]["plan"] = plan.to_dict()
        if engine.packed:
            record["format"] = packer.name
        if observer is not None:
            record["kv_cache"] = observer.record()
        write_config(recipe.model, tmp, record)
        dense = _dense_linears(handle, engine.packed)
        qc = packer.config(_packed_on_disk(handle, engine.packed), dense) if engine.packed else None
        qc = with_transforms(with_kv_cache_scheme(qc, kv_scheme, dense), transforms)
        if qc is not None:
            compute = packer.compute_dtype(engine.packed) if engine.packed else None
            _write_quantization_config(tmp, qc, compute)
            if compute is not None and compute != getattr(handle.config, "dtype", None):
                notes.append(f"config.json records dtype {str(compute).removeprefix('torch.')}, the dtype {packer.name} loaders compute its layers in")
        evaluation = None
        figures: dict[str, Any] = {}
        if recipe.evaluation is not None:
            ev = recipe.evaluation
            on_batch = (lambda d, t: progress("evaluation", d, t)) if progress else None
            evaluation = evaluate_checkpoint(
                tmp, ev.text, ev.ctx, ev.stride, ev.batch_size, recipe.model, recipe.device.value, ev.max_tokens, on_batch,
                kv_cache=ev.kv_cache,
            )
            figures = {
                f"perplexity on `{ev.text.name}` (ctx {ev.ctx})": f"{evaluation.perplexity:.4f}",
                "original model's perplexity": f"{evaluation.ref_perplexity:.4f}",
                "mean KLD vs original": f"{evaluation.kld:.5f}",
                **({"KV cache simulated": evaluation.kv_cache} if evaluation.kv_cache else {}),
            }
        write_model_card(tmp, recipe.output.path.name, record, figures)
    if recipe.export is not None:  # the finished checkpoint, also as one GGUF file
        from compress.run.export_stage import export_from_spec

        export_from_spec(recipe.output.path, recipe.export, progress, recipe.calibration, recipe.device.value)
    return RunResult(recipe.output.path, result, handle.reader.total_bytes(), dir_size(recipe.output.path), evaluation, notes,
                     [{"stage": index + 1, **plan.to_dict()} for index, plan in plans])
