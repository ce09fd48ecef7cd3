"""Export a checkpoint (llama, mistral, qwen2/3, phi3, gemma2/3, gpt2, mixtral, qwen2/3-MoE) to one GGUF file for llama.cpp.

What is written (ggml ``docs/gguf.md``; llama.cpp ``conversion/*.py``):

- metadata: ``general.architecture`` and what llama.cpp's converter records for it (context length,
  widths, head counts, RoPE base and dimension, RMS-norm epsilon, soft-capping, sliding window: the data in
  `compress.export.gguf_arch`), vocab size, file type and ``general.quantization_version = 2``; the
  tokenizer (`compress.formats.gguf.vocab`);
- tensors, under GGUF names, one at a time from the checkpoint (`CheckpointReader`): 1-D tensors (norms,
  biases) as F32 (Gemma's norms shifted by 1), every weight matrix in the type `plan.tensor_type` assigns. For
  the ``llama`` arch, ``attn_q``/``attn_k`` rows are permuted from HF's rotate-half RoPE layout to GGML's
  interleaved pairs (``LlamaModel.permute``) before encoding; the NEOX-RoPE archs need none. Tied
  embeddings: no ``output.weight`` is written, which llama.cpp and transformers both read as tied.

With an imatrix file (llama.cpp's format, e.g. from `compress imatrix`), each weight with an entry is
rounded by ggml's importance-weighted quantizers (``llama-quantize --imatrix``), and the file records
``quantize.imatrix.*`` as llama-quantize does. ``encoded`` hands in tensors already in their GGUF type
(GPTQ's result, `compress.export.calibrated`): they are written as they are (Q/K rows permuted).

The file is written under a temporary name next to the output and renamed when complete, while the
output's lock is held (`OutputLock`); its provenance (tool version, command, settings, SHA-256 of the
inputs) is embedded as ``llm_compress.record``, and the SHA-256 of the file and of each tensor go to the
sidecar ``<file>.manifest.json`` (`compress.checkpoints.integrity`). config.json is checked against the weights'
shapes (`open_model`) on a background thread while the first tensors are encoded: a mismatch stops the export with
that error, and no output is left.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from compress import __version__
from compress.checkpoints.background import Background
from compress.checkpoints.integrity import sidecar_manifest, write_file_manifest
from compress.checkpoints.model_io import open_model
from compress.checkpoints.output import OutputLock, check_outside_input, disk_error, remove_superseded, run_inputs
from compress.checkpoints.shards import CheckpointReader
from compress.errors import CompressError
from compress.export.encoding_pool import Pending, export_encoder, read_ahead
from compress.export.gguf_tensors import PlannedTensor, gqa, is_transposed, tensor_plan
from compress.export.gguf_arch import (
    ARCHITECTURES, NORM_SHIFT, PERMUTED_ARCHS, add_metadata, expert_count, read_config,
)
from compress.formats.gguf import plan
from compress.formats.gguf.imatrix import read_imatrix
from compress.formats.gguf.plan import Target
from compress.formats.gguf.sizes import GGMLType, row_bytes
from compress.formats.gguf.vocab import add_vocab
from compress.formats.gguf.writer import atomic_gguf_writer

log = logging.getLogger(__name__)


class GGUFMethod(str, enum.Enum):
    """How the GGUF weights are rounded."""

    rtn = "rtn"  # ggml's reference rounding (llama-quantize without an imatrix)
    imatrix = "imatrix"  # ggml's importance-weighted rounding (llama-quantize --imatrix)
    gptq = "gptq"  # GPTQ in the GGML block grids, calibrated (compress.export.calibrated)
    awq = "awq"  # AWQ scales searched against the GGML round trip, then ggml's rounding
    awq_gptq = "awq-gptq"  # AWQ scales, then GPTQ in the GGML grids
    autoround = "autoround"  # AutoRound's learned rounding in the GGML grids, calibrated (compress.export.calibrated)

    @property
    def scales(self) -> bool:
        return self in (GGUFMethod.awq, GGUFMethod.awq_gptq)

    @property
    def solves(self) -> bool:
        return self in (GGUFMethod.gptq, GGUFMethod.awq_gptq)

    @property
    def learns(self) -> bool:
        """Rounding learned block by block (AutoRound)."""
        return self is GGUFMethod.autoround

    @property
    def calibrated(self) -> bool:
        return self.scales or self.solves or self.learns


@dataclass(frozen=True)
class ExportConfig:
    model: Path
    output: Path
    target: Target = Target.q8_0
    overwrite: bool = False
    imatrix: Path | None = None  # llama.cpp imatrix GGUF: importance-weighted rounding, as llama-quantize --imatrix
    imatrix_source: str | None = None  # recorded as quantize.imatrix.file instead of the path (a collected, temporary one)
    importance_fit: bool = False  # the grids are fitted with importance weights without --imatrix (GPTQ's Hessian)
    # Provenance, embedded in the file (PROVENANCE_KEY): the command, the model the user named (a GGUF input's
    # conversion is ``model``), the rounding method and its calibration settings (with ``path``: its text).
    command: str | None = None
    source: Path | None = None
    method: str = "rtn"
    calibration: Mapping | None = None
    # A per-tensor plan (`compress allocate`): GGUF tensor name -> the type it is written in, over ``target``'s.
    types: Mapping[str, GGMLType] | None = None

    @property
    def has_imatrix(self) -> bool:
        """llama.cpp's ``has_imatrix``: some mixes (iq4_xs_mix) give more bits to tensors without one."""
        return self.imatrix is not None or self.importance_fit

    def __post_init__(self):
        if not isinstance(self.target, Target):
            raise CompressError(f"unknown GGUF type {self.target!r}: choose one of {', '.join(t.value for t in Target)}")


@dataclass
class TensorRecord:
    name: str
    shape: list[int]
    type: str
    bytes: int


@dataclass
class ExportResult:
    output: Path
    target: str
    architecture: str
    tensors: list[TensorRecord] = field(default_factory=list)
    file_bytes: int = 0
    weight_count: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    fallbacks: list[dict] = field(default_factory=list)  # tensors whose row length forced another type

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * sum(t.bytes for t in self.tensors) / max(self.weight_count, 1)

    def to_dict(self) -> dict:
        return {
            "output": str(self.output), "type": self.target, "architecture": self.architecture,
            "file_bytes": self.file_bytes, "weights": self.weight_count,
            "bits_per_weight": round(self.bits_per_weight, 4), "seconds": round(self.seconds, 3),
            "tensors": [t.__dict__ for t in self.tensors], "notes": self.notes, "fallbacks": self.fallbacks,
        }


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half row order -> GGML interleaved pairs, per head (llama.cpp ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


PROVENANCE_KEY = "llm_compress.record"  # JSON: tool version, command, settings, SHA-256 of the inputs


def recorded_inputs(config: ExportConfig) -> dict:
    """The SHA-256 of the export's inputs for its record (`run_inputs`): the source model's files, the calibration
    text, a given imatrix."""
    calibration = config.calibration or {}
    texts = {
        "calibration": Path(calibration["path"]) if calibration.get("path") else None,
        "imatrix": config.imatrix if config.imatrix_source is None else None,  # a collected one is a scratch file
    }
    return run_inputs(config.source or config.model, **texts)


def provenance(config: ExportConfig, inputs: dict | None = None) -> dict:
    """What made the file, as `compress.run` records it in config.json: known before any tensor is written,
    so it is embedded in the GGUF metadata; no clock time, so the same command writes the same bytes. ``inputs``:
    `recorded_inputs`, where the caller has hashed them already."""
    calibration = dict(config.calibration) if config.calibration else None
    return {
        "tool": "llm-compress", "tool_version": __version__, "source_model": str(config.source or config.model),
        "type": config.target.value, "method": config.method, "calibration": calibration,
        "inputs": recorded_inputs(config) if inputs is None else inputs, **({"command": config.command} if config.command else {}),
    }


@contextlib.contextmanager
def _guarded_output(out: Path, overwrite: bool):
    """Around the atomic GGUF writer: the output's lock (another run writing it is an error; temporary files
    of killed runs are reported), a full disk as a one-line error, and the sidecar manifest. Yields the
    writer's ``finish`` hook: it writes the manifest of the complete temporary file (and removes the old
    file's), so the manifest never describes another file than the one renamed into place."""
    lock = OutputLock(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stale = lock.acquire()
    if out.exists() and not overwrite:  # written by another run while this one was working
        lock.release()
        raise CompressError(f"{out} exists: pass --overwrite to replace it, or choose another -o")
    manifest = sidecar_manifest(out)
    pending = out.with_name(f".{out.name}.tmp-{os.getpid()}.manifest.json")

    def finish(tmp: Path) -> None:
        write_file_manifest(tmp, out.name, pending)
        manifest.unlink(missing_ok=True)  # a kill before the rename below leaves no manifest, not a wrong one

    try:
        yield finish
        os.replace(pending, manifest)
        remove_superseded(stale, out)
    except OSError as exc:
        error = disk_error(out, exc)
        if error is None:
            raise
        raise error from None
    finally:
        pending.unlink(missing_ok=True)
        lock.release()


def file_type(config: ExportConfig, entries: list[PlannedTensor]) -> int:
    """``general.file_type``: the target's, or for a per-tensor plan that of the type holding the most weights."""
    if not config.types:
        return plan.FILE_TYPE[config.target]
    return plan.planned_file_type((e.kind, int(np.prod(e.shape))) for e in entries if len(e.shape) > 1)


def check_output(config: ExportConfig) -> None:
    check_outside_input(config.output, config.model)
    if config.output.exists() and not config.overwrite:
        raise CompressError(f"{config.output} exists: pass --overwrite to replace it, or choose another -o")


def check_importance(entries, config: ExportConfig) -> None:
    """A one-line error unless every tensor of a type llama-quantize writes only from an importance matrix gets one."""
    unweighted = next((e for e in entries if plan.needs_imatrix(e.gguf, e.kind)), None) if not config.has_imatrix else None
    if unweighted is not None:
        raise CompressError(f"{unweighted.kind.name} ({unweighted.gguf}) needs an importance matrix, as llama-quantize requires: "
                            "export with --method imatrix, gptq or awq-gptq (and --calib TEXT), or --imatrix FILE")


def _importance(entry, gname: str, source: str, cols: int) -> np.ndarray:
    """The imatrix row for ``source`` (an expert's own row of a stacked tensor's entry), checked against the
    tensor as llama-quantize checks it ("imatrix size is different from tensor size")."""
    try:
        importance = entry.importance(plan.expert_index(source))
    except CompressError as exc:
        raise CompressError(f"{gname}: {exc}") from None
    if importance.shape != (cols,):
        raise CompressError(f"the imatrix entry for {gname} has {importance.shape[0]} columns, the tensor {cols}: "
                            "the imatrix was made for another model, collect one for this model")
    return importance


def export_gguf(
    config: ExportConfig,
    progress: Callable[[str, int, int], None] | None = None,
    encoded: Mapping[str, tuple[GGMLType, np.ndarray]] | None = None,
    inputs: Background | None = None,
    model_checked: bool = False,
) -> ExportResult:
    """Write ``config.model`` as a GGUF file at ``config.output``; see the module docstring.

    ``encoded``: HF layer name (without ``.weight``) -> (type, ``[out, row_bytes]`` bytes) to write as
    they are; each must have the type the plan gives that tensor. ``inputs``: `recorded_inputs` hashing since the
    caller's start (`Background`). ``model_checked``: the caller has opened ``config.model`` with `open_model`
    (whose check of config.json against the weights this then skips)."""
    start = time.perf_counter()
    hf = read_config(config.model)
    check_output(config)
    # config.json's sizes against the weights' shapes (transformers' model of the config on the meta device: ~2.7 s
    # of imports in a fresh process, 10% of a TinyLlama-sized export), checked while the first tensors are encoded
    check = Background(lambda: None if model_checked else open_model(config.model), "config check")
    try:
        result = _write(config, hf, encoded or {}, progress, check, inputs)
    except CompressError:
        check.result()  # a config that disagrees with the weights is the cause to name, whatever it broke first
        raise
    result.seconds = time.perf_counter() - start
    return result


def _write(config: ExportConfig, hf: dict, encoded: Mapping[str, tuple[GGMLType, np.ndarray]],
           progress: Callable[[str, int, int], None] | None, check: Background,
           inputs: Background | None) -> ExportResult:
    """`export_gguf`'s file, written while ``check`` runs: its failure stops the export (no output left)."""
    import gguf

    arch = ARCHITECTURES[hf["model_type"]]
    out = config.output
    reader = CheckpointReader(config.model)
    entries = tensor_plan(reader, hf, config.target, config.has_imatrix, config.types)
    imatrix = read_imatrix(config.imatrix) if config.imatrix is not None else None
    check_importance(entries, config)
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    result = ExportResult(out, config.target.value, arch)
    with _guarded_output(out, config.overwrite) as finish, atomic_gguf_writer(out, arch, finish) as writer:
        add_metadata(writer, arch, hf, file_type(config, entries))
        record = provenance(config, inputs.result() if inputs is not None else None)
        writer.add_string(PROVENANCE_KEY, json.dumps(record, sort_keys=True))
        vocab = add_vocab(writer, config.model, hf["vocab_size"])
        result.notes.extend(vocab.notes)
        if imatrix is not None:  # the keys llama-quantize records
            writer.add_string("quantize.imatrix.file", config.imatrix_source or str(config.imatrix))
            if imatrix.datasets:
                writer.add_string("quantize.imatrix.dataset", imatrix.datasets[0])
            writer.add_int32("quantize.imatrix.entries_count", len(imatrix.entries))
            writer.add_int32("quantize.imatrix.chunks_count", imatrix.chunk_count)
        tied = all(gname != "output.weight" for _, gname, _, _ in entries)
        for _, gname, kind, shape in entries:
            cols = shape[-1]
            intended = plan.intended_type(config.target, gname, tuple(shape), hf["num_hidden_layers"], tied,
                                          n_gqa=gqa(hf), has_imatrix=config.has_imatrix, n_expert=expert_count(hf))
            if config.types and gname in config.types:
                intended = kind  # planned per tensor: the plan chose what its row length takes
            if intended != kind:
                result.fallbacks.append({"tensor": gname, "planned": intended.name, "written": kind.name, "row_length": cols})
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = rows * row_bytes(kind, cols)
            byte_shape = [*shape[:-1], row_bytes(kind, cols)]
            writer.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
            result.tensors.append(TensorRecord(gname, shape, kind.name, nbytes))
            if len(shape) > 1:
                result.weight_count += rows * cols
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()

        def given_bytes(name: str) -> tuple[GGMLType, np.ndarray] | None:
            return encoded.get(name.removesuffix(".weight")) if name.endswith(".weight") else None

        def encode(name: str, gname: str, kind: GGMLType, shape: list[int]) -> Pending:
            """One checkpoint tensor in its GGUF form (an expert: its slice of the stacked tensor), being encoded."""
            given = given_bytes(name)
            if given is not None:
                if given[0] != kind or given[1].shape != (shape[-2], row_bytes(kind, shape[-1])):
                    raise CompressError(f"{name}: calibrated as {given[0].name} but the plan gives {kind.name}: rerun the export")
                rows = torch.from_numpy(given[1])  # rows of bytes permute like rows of weights
            else:
                rows = reader.get(name).to(torch.float32)
                if is_transposed(arch, gname, shape):
                    rows = rows.t().contiguous()
                if gname.endswith("norm.weight") and arch in NORM_SHIFT:
                    rows = rows + NORM_SHIFT[arch]
            if arch in PERMUTED_ARCHS and gname.startswith("blk.") and gname.split(".")[2] in ("attn_q", "attn_k"):
                rows = permute_rope(rows, heads if gname.split(".")[2] == "attn_q" else kv_heads)
            if given is not None:
                return Pending(value=rows.numpy())
            entry = imatrix.entries.get(gname) if imatrix is not None and len(shape) > 1 else None
            return encoder.submit(rows.numpy(), kind, _importance(entry, gname, name, shape[-1]) if entry is not None else None)

        to_encode = [(shape, kind) for sources, _, kind, shape in entries if any(given_bytes(n) is None for n in sources)]
        with export_encoder(to_encode, imatrix is not None) as encoder:  # threads or worker processes if worth it
            def read_tensor(sources: list[str], gname: str, kind: GGMLType, shape: list[int]) -> list[Pending]:
                return [encode(name, gname, kind, shape) for name in sources]  # experts stacked in order

            jobs = ((math.prod(entry[3]), partial(read_tensor, *entry)) for entry in entries)
            for written, parts in enumerate(read_ahead(jobs), 1):  # the next tensors are read while these are encoded
                data = [np.ascontiguousarray(part).reshape(-1) for part in parts]
                writer.write_tensor_data(data[0] if len(data) == 1 else np.concatenate(data))
                if progress:
                    progress("writing tensors", written, len(entries))
                check.raise_if_failed()
        check.result()  # before the file is renamed into place
    if result.fallbacks:  # as llama-quantize's "tensor cols N are not divisible by M, falling back"
        counts = Counter(f"{f['planned']}→{f['written']}" for f in result.fallbacks)
        result.notes.append(f"{len(result.fallbacks)} tensors fell back (row length not a multiple of the type's block, "
                            f"as llama.cpp does): " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    result.file_bytes = out.stat().st_size
    return result
