"""AWQ as an engine method: scale search per norm/linear group, folding, clipping search, quantization.

Per block: (1) replay the block once, recording each group's sub-block calls (attention, MLP, or the
layers themselves); (2) in forward order, search each group's scales on those recordings and fold them
into the producer; (3) replay again to record the (now scaled) inputs of the selected layers and search
their clipping ranges; (4) quantize. The algorithms are in `compress.quantizers.awq`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from compress.checkpoints.architecture import block_map, resolve_groups
from compress.engine.methods.base import LayerOutcome, LayerReport, Method
from compress.engine.methods.rtn import GridQuantConfig, InputQuantization
from compress.engine.one_pass import windows_of
from compress.engine.passes import split_hidden
from compress.checkpoints.model_io import get_weight, set_weight
from compress.quantizers.awq import AWQConfig, search_clip, search_scales
from compress.quantizers.rtn import rtn
from compress.engine.registry import register_method
from compress.engine.statistics import CallRecorder, GramScratch, Stat, add_upper_gram_, symmetric_from_upper


class AWQMethodConfig(GridQuantConfig):
    n_grid: int = Field(20, ge=1, description="α grid points in [0, 1) for the scale search")
    duo_scaling: bool = Field(False, description="scales s_x^α / s_w^(1-α) (AutoAWQ) instead of the paper's s_x^α")
    clip: bool = Field(True, description="search each group's clipping range on sample tokens")
    clip_grid: int = Field(20, ge=1, description="shrink steps of the clipping search")
    max_shrink: float = Field(0.5, ge=0, lt=1, description="narrowest range tried: 1 - max_shrink of min-max")
    clip_tokens: int = Field(512, ge=1, description="tokens sampled for the clipping search")
    search_tokens: int = Field(
        4096, ge=0, description="tokens (whole windows, evenly strided) each scale candidate runs its sub-block on; 0: all"
    )

    @model_validator(mode="after")
    def _clip_per_row(self):
        if self.clip and self.block_rows != 1:
            raise ValueError("clip chooses each row's range, which a scale shared by a block of rows cannot keep: set clip false")
        return self


def _output_error(calls, run, ranks) -> float:
    """Mean squared difference between recorded outputs and ``run(args, kwargs)`` over all calls (of every rank)."""
    total, count = 0.0, 0
    for args, kwargs, reference in calls:
        out = run(args, kwargs)
        # one fused pass (the same sum as (a − b).square().sum(), measured bit for bit; 25 → 15 ms on 16k × 576)
        total += F.mse_loss(out.float(), reference.float(), reduction="sum").item()
        count += reference.numel()
    total, count = ranks.sum_floats(total, count)
    return total / max(count, 1)


class _LinearOutputError:
    """`_output_error` for layers fed one recorded input (a group without a sub-module to inspect: v → o_proj,
    up → down_proj): ``Σ_calls ‖X Δᵀ‖² = tr(Δ G Δᵀ)`` with ``Δ = W_candidate − W`` and ``G = Σ XᵀX``, the same
    error as the layers' outputs give, from one Gram matrix. Why: a candidate then costs ``out·in²`` multiplications
    instead of ``tokens·in·out`` (o_proj on 16k tokens: 28× fewer), and these groups were a quarter of the search."""

    def __init__(self, calls, originals: list[torch.Tensor], ranks):
        """``originals``: the layers' weights ``[out, in]`` as they are (copies: folding changes the layers later)."""
        self.dtypes = [w.dtype for w in originals]
        self.originals = [w.float() for w in originals]
        width, device = self.originals[0].shape[1], self.originals[0].device
        self.gram = torch.zeros(width, width, dtype=torch.float64, device=device)  # an expert may get no token
        tokens, scratch = 0, GramScratch()
        for args, _, _ in calls:
            rows = args[0].reshape(-1, width).float()
            add_upper_gram_(self.gram, rows, scratch)
            tokens += rows.shape[0]
        self.gram = symmetric_from_upper(self.gram, dtype=torch.float32)
        self.count = tokens * sum(w.shape[0] for w in self.originals)
        self.ranks = ranks

    def __call__(self, candidates: list[torch.Tensor]) -> float:
        total = 0.0
        for w, original, dtype in zip(candidates, self.originals, self.dtypes):
            delta = w.to(dtype).float().to(self.gram.device) - original  # the layer's weight as it would be set
            total += (delta @ self.gram).mul_(delta).sum(dtype=torch.float64).item()
        total, count = self.ranks.sum_floats(total, self.count)
        return total / max(count, 1)


def _scaled_inputs(stats: dict, divisor: torch.Tensor | None) -> dict:
    """A layer's input statistics after AWQ divided its input channels by ``divisor``: each channel's
    maximum |x| divided alike (what a static activation scale must cover); the others as collected."""
    if divisor is None or Stat.INPUT_ABSMAX not in stats:
        return stats
    absmax = stats[Stat.INPUT_ABSMAX]
    return {**stats, Stat.INPUT_ABSMAX: absmax / divisor.to(absmax.device, absmax.dtype)}


def _search_windows(calls, tokens: int, ranks) -> list:
    """The recorded sub-block calls cut to whole windows (a call's first dimension; routed expert tokens: rows) on a
    global stride, about ``tokens`` tokens over every rank's calls: what each scale candidate is run on. Why: a
    candidate costs one forward of the sub-block over the windows it sees, 20 candidates a group, and the loss's
    choice of α is settled by far fewer tokens than a calibration set holds (docs/results.md, AWQ's search tokens)."""
    if tokens <= 0 or not calls:
        return calls
    hidden = [split_hidden(args, kwargs)[0] for args, kwargs, _ in calls]
    units = [h.shape[0] for h in hidden]
    per_unit = max(1, hidden[0].numel() // hidden[0].shape[-1] // max(1, units[0]))
    picked = ranks.strided_picks(sum(units), -(-tokens // per_unit)).tolist()
    if len(picked) == sum(units):
        return calls
    out, start = [], 0
    for (args, kwargs, reference), count in zip(calls, units):
        rows = [i - start for i in picked if start <= i < start + count]
        start += count
        if len(rows) == count:
            out.append((args, kwargs, reference))
        elif rows:
            part = torch.tensor(rows)
            out.append((windows_of(args, count, part), windows_of(kwargs, count, part), windows_of(reference, count, part)))
    return out


def _sample_tokens(calls, count: int, ranks) -> torch.Tensor:
    """``count`` evenly strided token vectors from the recorded inputs (of every rank, in order): ``[n, in]``."""
    parts = [args[0].reshape(-1, args[0].shape[-1]) for args, _, _ in calls]
    x = parts[0] if len(parts) == 1 else torch.cat(parts)  # one call (every window in one batch): no copy
    return ranks.strided_rows(x, count)


@register_method("awq")
class AWQ(InputQuantization, Method):
    """Scale salient input channels up before rounding, folding the inverse into the previous operator
    (integer or float grids; with activation quantization, the static input scales are those of the scaled inputs)."""

    Config = AWQMethodConfig

    @property
    def needs(self) -> frozenset[Stat]:
        return frozenset({Stat.INPUT_ABSMEAN}) | self.input_stats()

    def prepare(self, model) -> None:
        self.prepare_grid()
        self.model_type = model.config.model_type
        self.unclipped = set(block_map(self.model_type).unclipped)  # raises for unmapped architectures

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        self.check_grid(name, in_features)

    def _awq_config(self) -> AWQConfig:
        cfg = self.config
        return AWQConfig(cfg.scheme(), cfg.n_grid, cfg.duo_scaling, cfg.clip_grid, cfg.max_shrink)

    def transform_block(self, block, layers, stats, replay=None) -> list[LayerReport]:
        start = time.perf_counter()
        config = self._awq_config()
        relative = {module: name for name, module in block.named_modules()}
        selected = {relative[m]: full for full, m in layers.items()}  # relative name -> full name
        groups = [g for g in resolve_groups(block, self.model_type) if any(n in selected for n in g.group.layers)]
        info: dict[str, dict] = {name: {} for name in selected}
        divisors: dict[str, torch.Tensor] = {}  # relative name -> the scales its inputs are now divided by
        with torch.inference_mode():
            if groups:
                self._scale_groups(block, groups, stats, selected, replay, config, info, divisors)
            samples = self._clip_samples(block, selected, replay) if self.config.clip else {}
            reports = []
            for rel, full in selected.items():
                module = block.get_submodule(rel)
                weight = get_weight(module).detach().float()
                shrink = 1.0
                if rel in samples:
                    shrink = search_clip(weight, samples[rel].to(weight.device), config)
                    info[rel]["mean_clip"] = round(float(torch.as_tensor(shrink).mean()), 4)
                new_weight, quant = self.finish_layer(full, weight, shrink)
                set_weight(module, new_weight)
                if quant is not None:
                    outcome = LayerOutcome(new_weight, info[rel], quant=quant)
                    self.keep_outcome(full, self.with_inputs(full, outcome, _scaled_inputs(stats.get(full, {}), divisors.get(rel))))
                reports.append(LayerReport(full, tuple(weight.shape), 0.0, {**info[rel], **(quant.stats if quant else {})}))
        for report in reports:  # one search serves the whole block: share its time evenly
            report.seconds = (time.perf_counter() - start) / len(reports)
        return reports

    def round_trip(self, name: str):
        """The quantizer the scale search uses for layer ``name`` (None: the configured integer grid)."""
        return None

    def finish_layer(self, name: str, weight: torch.Tensor, shrink):
        """Quantize a scaled (and clipped) layer: its new weight and codes."""
        result = rtn(weight, self._awq_config().scheme, shrink)
        return result.weight, result

    def _scale_groups(self, block, groups, stats, selected, replay, config, info, divisors) -> None:
        inspected = {
            resolved.group.label: block.get_submodule(resolved.group.inspect) if resolved.group.inspect else resolved.layers[0]
            for resolved in groups
        }
        with CallRecorder(inspected) as recorder:
            replay()
        for resolved in groups:
            group, layers = resolved.group, resolved.layers
            x_mean = next(stats[selected[n]][Stat.INPUT_ABSMEAN] for n in group.layers if n in selected)
            calls = recorder.calls.pop(group.label)
            originals = [get_weight(m).detach().clone() for m in layers]
            if group.inspect:
                calls = _search_windows(calls, self.config.search_tokens, replay.ranks)
                inspect = inspected[group.label]

                def run(args, kwargs, inspect=inspect):
                    out = inspect(*args, **kwargs)
                    return out[0] if isinstance(out, (tuple, list)) else out

                def loss(candidates, layers=layers, calls=calls, run=run):
                    for module, w in zip(layers, candidates):
                        set_weight(module, w)
                    return _output_error(calls, run, replay.ranks)
            else:  # the layers themselves: their output error is a quadratic form of the weight change
                loss = _LinearOutputError(calls, originals, replay.ranks)

            quantizers = [self.round_trip(selected[n]) if n in selected else None for n in group.layers]
            search = search_scales(x_mean.to(originals[0].device), originals, loss, config, quantizers)
            for module, w in zip(layers, originals):
                set_weight(module, w)
            resolved.fold(search.scales.to(originals[0].device))  # into the producer, consumers and followers
            gain = search.rtn_loss / search.loss if search.loss > 0 else 1.0
            for name in group.layers:
                if name in selected:
                    info[name].update(alpha=search.alpha, scale_gain=round(gain, 3))
                    divisors[name] = search.scales

    def _clip_samples(self, block, selected, replay) -> dict[str, torch.Tensor]:
        modules = {rel: block.get_submodule(rel) for rel in selected if rel not in self.unclipped}
        if not modules:
            return {}
        with CallRecorder(modules) as recorder:
            replay()
        return {rel: _sample_tokens(calls, self.config.clip_tokens, replay.ranks) for rel, calls in recorder.calls.items()}
