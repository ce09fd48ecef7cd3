"""The contract between the layer-by-layer engine and a compression method.

A method says which calibration statistics it needs (`needs`) and transforms one decoder block at a
time. Most methods work layer by layer and only implement `transform_layer`, a thin adapter around a
pure algorithm in ``quantizers/`` or ``pruners/``; methods that couple layers (scaling folded between
them) override `transform_block`. The engine never asks a method's name.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from compress.checkpoints.model_io import get_weight, set_weight
from compress.quantizers.asymmetric import asymmetric_target
from compress.quantizers.result import QuantResult, concat_rows, split_rows
from compress.engine.statistics import Stat


class MethodConfig(BaseModel):
    """Base for every method's typed configuration: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)

    def wants_auto_group_size(self) -> bool:
        """The method quantizes in groups whose size is ``auto``, for the runner to choose from the layers."""
        return getattr(self, "group_size", None) == "auto"


class SolverConfig(MethodConfig):
    """Settings shared by the second-order solvers (GPTQ, SparseGPT, GPTQ in GGUF grids)."""

    block_size: int = Field(128, ge=1, description="columns per lazy-batch block")
    damp: float = Field(0.01, gt=0, description="dampening, as a fraction of the mean Hessian diagonal")
    true_sequential: bool = Field(True, description="solve q/k/v, o, gate/up, down in turn, each on updated inputs")
    asymmetric: bool = Field(False, description="fit each layer to the uncompressed model's outputs, undoing the drift "
                                                "of the layers before (GPTAQ; one more forward pass per statistics pass)")


@dataclass
class LayerOutcome:
    weight: torch.Tensor  # new weight [out, in], float32
    info: dict[str, Any] = field(default_factory=dict)
    # The integer codes behind ``weight`` (quantizers only): what a packed output format writes.
    quant: QuantResult | None = None
    # Static per-tensor activation scale (W8A8), written as ``<layer>.input_scale``.
    input_scale: torch.Tensor | None = None
    # The method quantizes this layer's inputs (W8A8): a later stage re-quantizing the weights keeps that.
    quantizes_input: bool = False
    # tr(W H Wᵀ) (second-order solvers): what ``info["error"]`` is relative to, kept so row slices' figures combine
    energy: float | None = None
    # the error and energy by row, float64 [out] (second-order solvers): so stacked layers' figures split
    error_rows: torch.Tensor | None = None
    energy_rows: torch.Tensor | None = None


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]  # (out_features, in_features)
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


class Method:
    name: ClassVar[str] = ""
    Config: ClassVar[type[MethodConfig]] = MethodConfig
    # attributes holding what the instance learns over the blocks (for its record): a resumed run restores them
    learned_state: ClassVar[tuple[str, ...]] = ()
    # True: `transform_layer` takes the weight in the block's own floating dtype and widens what it needs itself (a
    # bfloat16 block's layer is not first copied to float32: 235 MB for an 8B model's MLP layer); False: float32
    takes_stored_dtype: ClassVar[bool] = False

    def __init__(self, config: MethodConfig):
        self.config = config

    @property
    def needs(self) -> frozenset[Stat]:
        """Statistics of each layer's input this method needs (empty: no calibration data)."""
        return frozenset()

    def layer_needs(self, block: nn.Module, relative: str) -> frozenset[Stat]:
        """What of `needs` the layer ``relative`` (its name in ``block``) needs: by default all of it. A layer that
        needs nothing is left out of its block's statistics pass, which then may stop earlier (SmoothQuant with
        dynamic activation scales reads only the norm-fed layers' inputs); its ``stats`` come empty."""
        return self.needs

    def producers(self, block: nn.Module) -> list[tuple[str, tuple[str, ...]]] | None:
        """Whether this method may run inside the next stage's one pass (`compress.engine.one_pass`) rather than pass
        by pass before it: None (the default) where not; else the modules of ``block`` (relative names) whose output is
        the whole input of the listed layers. Each such group's statistics are read from that output and the group
        transformed just before the module runs, so its output is the transformed module's; the method's other
        layers are transformed first, with no statistics (their `layer_needs` must be empty)."""
        return None

    @property
    def block_inputs(self) -> bool:
        """True: `transform_block` reads the block's calibration calls (``replay.inputs``) and the uncompressed
        model's view of them (``replay.reference``: its inputs and the untouched block's outputs), so the engine
        captures the calibration data and carries the uncompressed model's stream beside it, as for `Stat.INPUT_DRIFT`."""
        return False

    @property
    def sequential(self) -> bool:
        """True: transform a block's layers group by group in forward order, each group's statistics
        collected after the groups before it were transformed (GPTQ's "true sequential")."""
        return False

    @property
    def layerwise(self) -> bool:
        """True: each layer is transformed alone (`transform_layer`, no `transform_block` of its own), so
        the engine may solve a block's layers on different processes."""
        return type(self).transform_block is Method.transform_block

    @property
    def row_parallel(self) -> bool:
        """True: a layer's rows can be transformed apart, each slice with the whole layer's statistics
        (`transform_layer` on ``weight[rows]``), and the slices' outcomes merged (`merge_rows`), so the engine
        may split one layer over processes. Its ``learned_state`` must come out the same from every slice."""
        return False

    def merge_rows(self, parts: list[LayerOutcome]) -> LayerOutcome:
        """One layer's outcome from its row slices' (`row_parallel`), in row order."""
        raise NotImplementedError

    def prepare(self, model: nn.Module) -> None:
        """Learn what the method needs of the architecture (``model`` is the weightless skeleton), raising
        `CompressError` before any work starts if it cannot run on it."""

    def check_layer(self, name: str, out_features: int, in_features: int) -> None:
        """Raise `CompressError` before any work starts if this layer cannot take the method."""

    def transform_layer(self, name: str, weight: torch.Tensor, stats: dict[Stat, torch.Tensor]) -> LayerOutcome:
        raise NotImplementedError

    def transform_block(
        self,
        block: nn.Module,
        layers: dict[str, nn.Module],
        stats: dict[str, dict[Stat, torch.Tensor]],
        replay: Callable[[], object] | None = None,
    ) -> list[LayerReport]:
        """Transform the selected layers of one block in place; the default goes layer by layer, and layers
        fed the very same input (one statistics dict, `StatsCollector.results`) through `transform_shared`.

        ``replay()`` runs the block on the calibration inputs again (None outside blocks), for methods
        that measure the block's outputs under candidate weights (AWQ's scale search); ``replay.ranks``
        combines such figures over the processes that share the calibration data (`compress.engine.ranks`); with
        `block_inputs`, ``replay.inputs`` and ``replay.reference`` hold the calls themselves."""
        reports = {}
        for names in _by_shared_statistics(layers, stats):
            start = time.perf_counter()
            weights = [self.layer_weight(layers[name]) for name in names]
            if len(names) > 1:
                outcomes = self.transform_shared(names, weights, stats[names[0]])
            else:
                outcomes = [self.transform_layer(names[0], weights[0], stats.get(names[0], {}))]
            share = (time.perf_counter() - start) / sum(w.shape[0] for w in weights)  # each layer's time by its rows
            for name, weight, outcome in zip(names, weights, outcomes):
                set_weight(layers[name], outcome.weight)
                self.keep_outcome(name, outcome)
                reports[name] = LayerReport(name, tuple(weight.shape), share * weight.shape[0], outcome.info)
        return [reports[name] for name in layers]

    def layer_weight(self, module: nn.Module) -> torch.Tensor:
        """The weight `transform_layer` takes for ``module``: ``[out, in]``, float32 unless `takes_stored_dtype`."""
        weight = get_weight(module).detach()
        return weight if self.takes_stored_dtype else weight.float()

    def transform_shared(self, names: list[str], weights: list[torch.Tensor], stats: dict[Stat, torch.Tensor]) -> list[LayerOutcome]:
        """The outcomes of layers ``names`` fed the very same input (``stats``, theirs alike), in order; the
        default transforms them one at a time."""
        return [self.transform_layer(name, weight, stats) for name, weight in zip(names, weights)]

    def keep_outcome(self, name: str, outcome: LayerOutcome) -> None:
        """Hand a finished layer's codes (``outcome.quant``/``input_scale``) to the engine, which packs
        them; methods overriding `transform_block` call it for each layer they quantize."""
        if outcome.quant is not None or outcome.input_scale is not None or outcome.quantizes_input:
            self.__dict__.setdefault("_kept", {})[name] = outcome

    def take_outcomes(self) -> dict[str, LayerOutcome]:
        """The outcomes kept since the last call (the engine collects them after each `transform_block`)."""
        return self.__dict__.pop("_kept", {})

    def record(self) -> dict[str, Any]:
        """What is written to the output's config.json about this method."""
        return {"method": self.name, **self.config.model_dump(mode="json")}


@dataclass
class Rewritten:
    """What a `CheckpointMethod` wrote: the output's config.json (before the compression record is added),
    the method's record, lines for the summary, and extra files (name → text) for the output."""

    config: dict[str, Any]
    record: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


class CheckpointMethod(Method):
    """A method that rewrites the whole checkpoint (structured pruning, rotations). It cannot transform blocks in
    place on the engine: it reads the checkpoint and writes a new one. One that changes the model's shapes runs as
    a recipe's only stage; one that ``keeps_shapes`` runs first, and the stages after it run on its output."""

    keeps_shapes: ClassVar[bool] = False

    def rewrite(self, handle, calibration: torch.Tensor | None, directory, device: torch.device, batch_size: int,
                progress: Callable[[str, int, int], None] | None = None) -> Rewritten:
        """Write the new weights into ``directory`` (an empty folder) from ``handle`` (a lazily opened
        `ModelHandle`) and ``calibration`` token windows ``[samples, seq_len]``."""
        raise NotImplementedError


class HessianMethod(Method):
    """Base for second-order solvers (GPTQ, SparseGPT): Hessian statistics, optional true-sequential,
    and solver failures reported as user errors naming the layer."""

    label: ClassVar[str] = ""

    @property
    def needs(self) -> frozenset[Stat]:
        return frozenset({Stat.HESSIAN, Stat.INPUT_DRIFT} if self.config.asymmetric else {Stat.HESSIAN})

    @property
    def sequential(self) -> bool:
        return self.config.true_sequential

    @property
    def row_parallel(self) -> bool:
        """The solvers' rows are independent given H (GPTQ's column loop, SparseGPT's per-row masks, the asymmetric
        target ``W + WΔ(H+λI)⁻¹``); a grid whose scale spans rows (FP8 blocks, NVFP4's per-tensor scale) is not."""
        scheme = self.config.scheme()
        return scheme is None or scheme.rows_independent

    def merge_rows(self, parts: list[LayerOutcome]) -> LayerOutcome:
        """Weights and codes stacked; ``error`` summed and ``rel_error`` taken on the summed energy; ``sparsity``
        weighted by rows; the damping and dead columns, which depend on H alone, are the slices' own."""
        first, rows = parts[0], [p.weight.shape[0] for p in parts]
        info = dict(first.info)
        energy = sum(p.energy for p in parts)
        if "error" in info:
            info["error"] = sum(p.info["error"] for p in parts)
            info["rel_error"] = info["error"] / energy if energy > 0 else 0.0
        if "sparsity" in info:
            info["sparsity"] = sum(p.info["sparsity"] * n for p, n in zip(parts, rows)) / sum(rows)
        quant = concat_rows([p.quant for p in parts]) if first.quant is not None else None
        by_row = {k: torch.cat([getattr(p, k) for p in parts]) for k in ("error_rows", "energy_rows") if getattr(first, k) is not None}
        return dataclasses.replace(first, weight=torch.cat([p.weight for p in parts]), info=info, quant=quant, energy=energy, **by_row)

    def split_rows(self, whole: LayerOutcome, rows: list[int]) -> list[LayerOutcome]:
        """The outcomes of consecutive slices of ``rows`` rows each of a layer solved whole (the inverse of
        `merge_rows`): each slice's ``error`` and energy the sums of its rows' (``error_rows``, ``energy_rows``),
        ``sparsity`` counted on its weight, the damping and dead columns (H's alone) the whole's."""
        quants = split_rows(whole.quant, rows) if whole.quant is not None else [None] * len(rows)
        parts = []
        for weight, quant, error_rows, energy_rows in zip(whole.weight.split(rows), quants, whole.error_rows.split(rows),
                                                          whole.energy_rows.split(rows)):
            info, energy = dict(whole.info), float(energy_rows.sum())
            if "error" in info:
                info["error"] = float(error_rows.sum())
                info["rel_error"] = info["error"] / energy if energy > 0 else 0.0
            if "sparsity" in info:
                info["sparsity"] = int((weight == 0).sum()) / weight.numel()
            parts.append(dataclasses.replace(whole, weight=weight, info=info, quant=quant, energy=energy,
                                             error_rows=error_rows, energy_rows=energy_rows))
        return parts

    # Layers fed one input are solved stacked up to this many weights (256 MB in float32): past it the column loop's
    # per-column overhead, which stacking saves, is a small share, and the stack's working copies would raise the peak.
    stack_elements: ClassVar[int] = 1 << 26

    def transform_layer(self, name, weight, stats) -> LayerOutcome:
        return self.finish(name, self.solved(name, weight, stats), stats)

    def transform_shared(self, names, weights, stats) -> list[LayerOutcome]:
        """Layers fed one input share ``H``, and the solvers' rows are independent given it (`row_parallel`): they
        are solved as one weight, their rows stacked (the same bits as one by one; one factorization of ``H`` and one
        column loop instead of one each: 2.3x faster on SmolLM2's q/k/v, 1.3x on gate/up), as long as the stack
        stays within `stack_elements`."""
        if not self.row_parallel:
            return super().transform_shared(names, weights, stats)
        outcomes = []
        for run in self.stacks(weights):
            stack, rows = names[run], [w.shape[0] for w in weights[run]]
            whole = self.solved(", ".join(stack), torch.cat(weights[run]) if len(stack) > 1 else weights[run.start], stats)
            parts = self.split_rows(whole, rows) if len(stack) > 1 else [whole]
            outcomes += [self.finish(name, part, stats) for name, part in zip(stack, parts)]
        return outcomes

    def stacks(self, weights: list[torch.Tensor]) -> list[slice]:
        """``weights`` cut into runs of consecutive ones, each run as many as stay within `stack_elements` together."""
        runs, start = [], 0
        while start < len(weights):
            end, size = start + 1, weights[start].numel()
            while end < len(weights) and size + weights[end].numel() <= self.stack_elements:
                size, end = size + weights[end].numel(), end + 1
            runs.append(slice(start, end))
            start = end
        return runs

    def solved(self, name: str, weight: torch.Tensor, stats: dict[Stat, torch.Tensor]) -> LayerOutcome:
        """The solver's outcome for ``weight`` (a layer's, or several layers' stacked by rows; ``name`` says which)."""
        raise NotImplementedError

    def finish(self, name: str, outcome: LayerOutcome, stats: dict[Stat, torch.Tensor]) -> LayerOutcome:
        """Layer ``name``'s outcome from its rows of a solve (what the method adds per layer); as is by default."""
        return outcome

    def solve(self, name: str, solver, weight: torch.Tensor, stats: dict[Stat, torch.Tensor], config, keys: tuple[str, ...]):
        """Run ``solver(weight, H, config)``; returns the layer outcome with the ``keys`` of its stats. With the
        INPUT_DRIFT statistic the solver's weight is the asymmetric target (`compress.quantizers.asymmetric`)."""
        from compress.errors import CompressError

        try:
            if Stat.INPUT_DRIFT in stats:
                weight = asymmetric_target(weight, stats[Stat.HESSIAN], stats[Stat.INPUT_DRIFT], self.config.damp)
            result = solver(weight, stats[Stat.HESSIAN], config)
        except ValueError as exc:
            raise CompressError(f"{self.label} failed on {name}: {exc}") from None
        quant = result if isinstance(result, QuantResult) else getattr(result, "quant", None)  # SparseGPT joint
        info = {k: result.stats[k] for k in keys if k in result.stats}
        return LayerOutcome(result.weight, info, quant=quant, energy=result.stats.get("energy"),
                            error_rows=result.stats.get("error_rows"), energy_rows=result.stats.get("energy_rows"))


def _by_shared_statistics(layers: dict[str, nn.Module], stats: dict) -> list[list[str]]:
    """``layers``' names in sets holding one statistics dict (fed the very same input), in first-seen order."""
    sets: dict[object, list[str]] = {}
    for name in layers:
        shared = stats.get(name)
        sets.setdefault(id(shared) if shared else name, []).append(name)
    return list(sets.values())
