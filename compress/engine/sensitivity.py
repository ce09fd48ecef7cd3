"""Per-layer sensitivity measured on the engine: what each candidate scheme costs each layer.

For every selected layer and candidate (`compress.formats.candidates`), one block at a time on the
calibration windows:

1. the layer is quantized alone with the candidate, by GPTQ (its own grid, or the GGML type's with
   `quantizers.gguf_gptq`) on the block's Hessian, or by round to nearest (``Solver.rtn``);
2. the figures: GPTQ's proxy ``layer_error = tr((W − Q) H (W − Q)ᵀ)`` (``H = 2/n·XXᵀ``, the mean squared
   error of the layer's output, ×2) and ``rel_error`` (divided by ``tr(W H Wᵀ)``); and ``residual_error``,
   the block replayed with only that layer quantized: ``mean_t ‖h'_t − h_t‖² / ‖h_t‖²`` over the tokens of
   the block's output (the residual stream), so errors that attention's softmax or the MLP's gate damp or
   amplify are seen as the next block sees them. Both are taken on the original model's inputs.
3. GGUF candidates also cover the token embeddings (ggml's rounding; ``residual_error`` at the first
   block's input, and ``kld`` exactly: one more stream per candidate carries the perturbed embeddings
   through the original blocks) and the output layer (GPTQ on the final norm's outputs; its ``kld``
   measured exactly on the calibration logits). Tied embeddings are measured as both (klds added).

To put the residual errors in KLD units, the engine also carries one extra hidden-state stream per
candidate through the blocks, with *every* measured layer quantized that way (the same ``Q``s): at the
end, the final norm and the output layer give its logits, and ``uniform_kld[candidate]`` is their mean
KLD from the original logits over the calibration tokens. `compress.run.plan` fits the gain from the
residual errors to those KLDs.

Memory: one block's weights (and each candidate's ``Q`` of them), and ``1 + candidates`` copies of the
calibration hidden states (``1 + 2 · candidates`` with the embeddings measured).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

from compress.checkpoints.architecture import FINAL_NORMS
from compress.checkpoints.model_io import ModelHandle, get_weight, set_weight
from compress.engine.block_engine import Engine, Stage
from compress.engine.methods.base import LayerReport, Method
from compress.engine.statistics import InputStatistics, Stat
from compress.errors import CompressError
from compress.formats.candidates import Candidate
from compress.formats.gguf.codecs import round_trip
from compress.formats.gguf.grids import is_block_quantized
from compress.formats.gguf.sizes import GGMLType
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, gguf_gptq
from compress.quantizers.gptq import GPTQConfig, gptq, layer_error
from compress.quantizers.rtn import rtn

log = logging.getLogger(__name__)
KLD_CHUNK = 1024  # tokens per logits chunk: [chunk, vocabulary] floats at a time


class Solver(str, enum.Enum):
    gptq = "gptq"
    rtn = "rtn"


@dataclass(frozen=True)
class SolverSettings:
    """How each candidate is applied to a layer (the settings `compress quantize` would use)."""

    solver: Solver = Solver.gptq
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128


@dataclass
class Measured:
    """One layer under one candidate."""

    bytes: int
    stored: str  # the candidate, or the GGML type it falls back to for this row length
    layer_error: float | None = None
    rel_error: float | None = None
    residual_error: float | None = None
    kld: float | None = None  # output layers: the exact mean KLD of the calibration logits


@dataclass
class SensitivityRun:
    layers: dict[str, dict[str, Measured]] = field(default_factory=dict)
    uniform_kld: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0


def quantize_with(candidate: Candidate, weight: torch.Tensor, hessian: torch.Tensor | None, settings: SolverSettings) -> torch.Tensor:
    """``weight [out, in]`` quantized by ``candidate`` (dequantized float32); ``hessian`` None: rounding."""
    if candidate.is_gguf:
        kind = candidate.stored_type(weight.shape[1])
        if not is_block_quantized(kind):  # F16/BF16: a cast, nothing to solve
            dtype = torch.bfloat16 if kind == GGMLType.BF16 else torch.float16
            return weight.to(dtype).float()
        if settings.solver == Solver.gptq and hessian is not None:
            config = GGUFGPTQConfig(kind, settings.block_size, settings.damp)
            return gguf_gptq(weight.cpu(), hessian.cpu(), config).weight.to(weight.device)
        return torch.from_numpy(round_trip(weight.detach().float().cpu().numpy(), kind)).to(weight.device)
    if settings.solver == Solver.gptq and hessian is not None:
        config = GPTQConfig(candidate.scheme, block_size=settings.block_size, damp=settings.damp, act_order=settings.act_order)
        return gptq(weight, hessian, config).weight
    return rtn(weight, candidate.scheme).weight


def relative_error(changed: list[torch.Tensor], clean: list[torch.Tensor]) -> float:
    """``mean_t ‖changed_t − clean_t‖² / ‖clean_t‖²`` over every token vector of the batches."""
    total, count = 0.0, 0
    for a, b in zip(changed, clean):
        den = b.float().square().sum(-1).clamp_min(1e-30)
        total += float(((a.float() - b.float()).square().sum(-1) / den).sum())
        count += den.numel()
    return total / max(count, 1)


class _Measure(Method):
    """Measures each layer of a block under each candidate; leaves the weights as they were."""

    name = "measure"

    def __init__(self, candidates: list[Candidate], sizes: dict[str, dict[str, tuple[int, str]]], settings: SolverSettings):
        super().__init__(None)  # type: ignore[arg-type]
        self.candidates, self.sizes, self.settings = candidates, sizes, settings
        self.quantized: dict[str, dict[str, torch.Tensor]] = {}  # this block's Qs, for the uniform streams
        self.measured: dict[str, dict[str, Measured]] = {}

    @property
    def needs(self):
        return frozenset({Stat.HESSIAN})

    def transform_block(self, block, layers, stats, replay=None) -> list[LayerReport]:
        clean = replay()
        reports = []
        for name, module in layers.items():
            start = time.perf_counter()
            weight = get_weight(module).detach().float().clone()
            hessian = stats[name][Stat.HESSIAN]
            figures = self.measured.setdefault(name, {})
            measured_as: dict[str, str] = {}  # stored form -> the candidate measured in it (for this row length)
            for candidate in self.candidates:
                size, stored = self.sizes[name][candidate.name]
                twin = measured_as.setdefault(stored, candidate.name)
                if twin != candidate.name:  # falls back to a type already measured here (q2_k, q3_k -> Q4_0): same numbers
                    figures[candidate.name] = replace(figures[twin])
                    self.quantized[name][candidate.name] = self.quantized[name][twin]
                    continue
                quantized = quantize_with(candidate, weight, hessian, self.settings)
                set_weight(module, quantized)
                try:
                    residual = relative_error(replay(), clean)
                finally:
                    set_weight(module, weight)
                error, rel = layer_error(weight, quantized, hessian)
                figures[candidate.name] = Measured(size, stored, error, rel, residual)
                self.quantized.setdefault(name, {})[candidate.name] = quantized
            info = {c: round(m.residual_error, 8) for c, m in figures.items()}
            reports.append(LayerReport(name, tuple(weight.shape), time.perf_counter() - start, info))
        return reports


class _SensitivityEngine(Engine):
    """The engine, carrying one extra hidden-state stream per candidate (every measured layer at it)."""

    def __init__(self, handle, measure: _Measure, layers, embed_inputs: Callable | None, **kwargs):
        super().__init__(handle, [Stage(measure, layers)], keep_final_hidden=True, **kwargs)
        self.measure = measure
        self.embed_inputs = embed_inputs  # (candidate name, batch index, clean hidden) -> perturbed hidden
        self.streams: dict[str, list[torch.Tensor]] = {}  # every measured layer at the candidate
        self.embed_streams: dict[str, list[torch.Tensor]] = {}  # only the input embeddings at the candidate

    def capture_inputs(self, calibration, weights=None):
        inputs = super().capture_inputs(calibration, weights)
        for candidate in self.measure.candidates:
            self.streams[candidate.name] = [
                self.embed_inputs(candidate.name, i, h) if self.embed_inputs else h for i, (h, _, _) in enumerate(inputs)
            ]
            if self.embed_inputs:
                self.embed_streams[candidate.name] = list(self.streams[candidate.name])
        return inputs

    def _compress_block(self, index, inputs):
        reports = super()._compress_block(index, inputs)
        block, quantized = self.handle.blocks[index], self.measure.quantized
        originals = {name: get_weight(block.get_submodule(self._relative(index, name))).detach().clone() for name in quantized}
        try:
            for candidate in self.measure.candidates:
                for name, by_candidate in quantized.items():
                    set_weight(block.get_submodule(self._relative(index, name)), by_candidate[candidate.name])
                stream = [(h, args, kwargs) for h, (_, args, kwargs) in zip(self.streams[candidate.name], inputs)]
                self.streams[candidate.name] = self._run_block(block, stream)
        finally:
            for name, weight in originals.items():
                set_weight(block.get_submodule(self._relative(index, name)), weight)
            quantized.clear()
        for name, hidden in self.embed_streams.items():  # the original block on the embedding-perturbed stream
            self.embed_streams[name] = self._run_block(block, [(h, a, k) for h, (_, a, k) in zip(hidden, inputs)])
        return reports

    def _relative(self, index: int, name: str) -> str:
        return name.removeprefix(self._block_names[index] + ".")


def _kld_sums(reference: list[torch.Tensor], w_ref: torch.Tensor,
              compared: dict[object, tuple[Callable[[int], torch.Tensor], torch.Tensor]]) -> dict[object, float]:
    """Σ_t KL(softmax(reference_t w_refᵀ) ‖ softmax(x_t wᵀ)) over the token vectors of every batch, for each
    ``key: (x, w)`` of ``compared`` (``x(i)``: batch i's vectors), in chunks; each reference chunk's
    log-probabilities are computed once for all the comparisons (the vocabulary-wide softmax is the cost)."""
    totals = dict.fromkeys(compared, 0.0)
    for i, ref in enumerate(reference):
        ref_rows = ref.reshape(-1, ref.shape[-1])
        rows = {key: x(i).reshape(-1, ref.shape[-1]) for key, (x, _) in compared.items()}
        for start in range(0, ref_rows.shape[0], KLD_CHUNK):
            chunk = slice(start, start + KLD_CHUNK)
            # float64 softmax: small KLDs are differences of nearly equal log-probabilities
            p = (ref_rows[chunk].float() @ w_ref.t()).double().log_softmax(-1)
            probs = p.exp()
            for key, (_, w) in compared.items():
                q = (rows[key][chunk].float() @ w.t()).double().log_softmax(-1)
                totals[key] += float((probs * (p - q)).sum())
    return totals


def measure_sensitivity(
    handle: ModelHandle,
    calibration: torch.Tensor,
    candidates: list[Candidate],
    layers: dict[str, nn.Module],
    settings: SolverSettings = SolverSettings(),
    device: torch.device | str = "cpu",
    batch_size: int = 8,
    progress=None,
    on_layer=None,
    scale_bytes: int = 2,
) -> SensitivityRun:
    """Measure ``layers`` (block linears; GGUF candidates also the input embeddings and the output layer,
    by their module names) under each candidate on ``calibration`` (``[samples, seq_len]`` token ids)."""
    start = time.perf_counter()
    device = torch.device(device)
    model = handle.model
    embed_module, head_module = model.get_input_embeddings(), model.get_output_embeddings()
    embed_name, head_name = handle.module_name(embed_module), handle.module_name(head_module)
    tied = embed_module is not None and handle.head_is_tied()
    blocks = tuple(handle.block_name(i) + "." for i in range(len(handle.blocks)))
    inside = {n: m for n, m in layers.items() if n.startswith(blocks)}
    outside = [n for n in layers if n not in inside]
    if any(n not in (embed_name, head_name) for n in outside) or (outside and not all(c.is_gguf for c in candidates)):
        raise CompressError(
            f"{outside[0]} is outside the decoder blocks: only GGUF candidates measure layers outside them "
            "(the input embeddings and the output layer); exclude it"
        )
    if outside and handle.config.model_type not in FINAL_NORMS:
        raise CompressError(f"no final norm known for {handle.config.model_type}: exclude {outside[0]}")
    if not inside:
        raise CompressError("no decoder-block layers selected: check --include/--exclude")

    def sizes_of(name: str, shape: tuple[int, int]) -> dict[str, tuple[int, str]]:
        out = {}
        for c in candidates:
            size = c.stored_bytes(shape[0], shape[1], scale_bytes)
            if size is None:
                raise CompressError(f"candidate {c.name} cannot store {name} ([{shape[0]}, {shape[1]}]): drop it or exclude the layer")
            stored = c.stored_type(shape[1])
            out[c.name] = (size, c.name if stored is None or stored == c.ggml else stored.name.lower())
        return out

    sizes = {n: sizes_of(n, tuple(get_weight(m).shape)) for n, m in layers.items()}
    measure = _Measure(candidates, sizes, settings)
    batches = calibration.split(batch_size)
    embed_weight, embed_q = None, {}
    if embed_name in layers:
        embed_weight = handle.reader.get(handle.checkpoint_key(f"{embed_name}.weight")).float().to(device)
        embed_q = {c.name: quantize_with(c, embed_weight, None, settings) for c in candidates}

    def embed_inputs(candidate: str, i: int, h: torch.Tensor) -> torch.Tensor:
        tokens = batches[i].to(device)
        return h + (embed_q[candidate][tokens] - embed_weight[tokens]).to(h.dtype)

    engine = _SensitivityEngine(
        handle, measure, inside, embed_inputs if embed_q else None, device=device, batch_size=batch_size,
        progress=progress, on_layer=on_layer,
    )

    class _Discard:
        def add(self, name, tensor):
            pass

    # the output side is read after every block has run: a checkpoint that lacks it fails now, not then
    norm_name = FINAL_NORMS.get(handle.config.model_type)
    for name in (f"{embed_name if tied else head_name}.weight", *([f"{norm_name}.weight"] if norm_name else [])):
        handle.checkpoint_key(name)
    result = engine.run(_Discard(), calibration)
    run = SensitivityRun(measure.measured, tokens=int(calibration.numel()))
    output = _Output(embed_name, head_name, tied, embed_weight, embed_q, head_name in layers or bool(tied and embed_q))
    _finish(handle, run, engine.streams, engine.embed_streams, result.final_hidden, candidates, settings, sizes, device, output, batches)
    run.seconds = time.perf_counter() - start
    return run


@dataclass
class _Output:
    embed_name: str | None
    head_name: str | None
    tied: bool
    embed_weight: torch.Tensor | None  # measured embeddings only
    embed_q: dict[str, torch.Tensor]
    measure_head: bool


def _finish(handle, run, streams, embed_streams, final_hidden, candidates, settings, sizes, device, out: _Output, batches):
    """The output side: the embeddings' input error, the output layer's KLD, each stream's KLD."""
    model = handle.model
    norm_name = FINAL_NORMS.get(handle.config.model_type)
    if norm_name is None:
        raise CompressError(f"no final norm known for {handle.config.model_type}: the uniform KLDs need one")
    norm = model.get_submodule(norm_name)
    handle.materialize(norm, norm_name, device, torch.float32)
    head_weight = f"{out.embed_name if out.tied else out.head_name}.weight"
    w_head = handle.reader.get(handle.checkpoint_key(head_weight)).float().to(device)
    embed_name, head_name, tied, embed_weight, embed_q = out.embed_name, out.head_name, out.tied, out.embed_weight, out.embed_q
    try:
        with torch.inference_mode():
            clean = [norm(h) for h in final_hidden]
            head_q: dict[str, torch.Tensor] = {}
            hessian = None
            if out.measure_head:
                if tied:
                    head_q = dict(embed_q)
                else:
                    stats = InputStatistics(w_head.shape[1], frozenset({Stat.HESSIAN}), device)
                    for x in clean:
                        stats.update(x)
                    hessian = stats.result()[Stat.HESSIAN]
                    for c in candidates:
                        head_q[c.name] = quantize_with(c, w_head, hessian, settings)
            compared = {}
            for c in candidates:
                if c.name in head_q:  # the output layer alone: clean inputs, quantized head
                    compared["head", c.name] = (clean.__getitem__, head_q[c.name])
                if embed_q:  # the embeddings alone: their perturbed stream, clean head
                    compared["embed", c.name] = (lambda i, s=embed_streams[c.name]: norm(s[i]), w_head)
                compared["uniform", c.name] = (lambda i, s=streams[c.name]: norm(s[i]), head_q.get(c.name, w_head))
            totals = {key: total / run.tokens for key, total in _kld_sums(clean, w_head, compared).items()}
            if head_q:
                key = embed_name if tied else head_name  # GGUF stores tied weights once, as the embeddings
                figures = run.layers.setdefault(key, {})
                for c in candidates:
                    size, stored = sizes[key][c.name]
                    error, rel = (None, None) if tied else layer_error(w_head, head_q[c.name], hessian)
                    figures[c.name] = Measured(size, stored, error, rel, None, totals["head", c.name])
            if embed_q:
                figures = run.layers.setdefault(embed_name, {})
                first = [embed_weight[b.to(device)] for b in batches]
                for c in candidates:
                    perturbed = [h + (embed_q[c.name][b.to(device)] - embed_weight[b.to(device)]) for h, b in zip(first, batches)]
                    residual = relative_error(perturbed, first)
                    kld = totals["embed", c.name]
                    if c.name in figures:  # tied: measured as the output layer too; both effects add
                        figures[c.name].residual_error = residual
                        figures[c.name].kld += kld
                    else:
                        size, stored = sizes[embed_name][c.name]
                        figures[c.name] = Measured(size, stored, None, None, residual, kld)
            for c in candidates:
                run.uniform_kld[c.name] = totals["uniform", c.name]
    finally:
        handle.release(norm)
    if not np.isfinite(list(run.uniform_kld.values())).all():
        raise CompressError("the measured KLDs are not finite: the model overflows in float32 on this calibration data")
