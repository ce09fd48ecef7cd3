"""The layer-by-layer engine every calibration method runs on.

1. Capture the inputs of decoder block 0 for the calibration samples (hidden states and whatever
   extra arguments the architecture passes: attention mask, position ids/embeddings), by running the
   model's base with only its non-block weights materialized and stopping at block 0.
2. For each block: materialize it on the compute device; for each stage, collect the statistics the
   stage's method needs with hooks on the selected layers (asymmetric calibration: beside an untouched copy of
   the block run on the original model's inputs, `compress.engine.reference`), then let the method transform the block;
   recompute the block's outputs with the transformed weights, which become the next block's inputs;
   write the block to the output and release it.
3. Copy (or, for methods needing no statistics, transform) the tensors outside the blocks (`compress.engine.outer`).

True-sequential layer-by-layer methods (GPTQ, SparseGPT) collect statistics, solve and propagate in one forward
pass where the calibration windows fit in one batch (`compress.engine.one_pass`).

Only one block's weights are in compute memory at a time. The engine never tests a method's name.
With several processes (`compress.engine.ranks`), each runs its share of the calibration windows,
statistics are combined over all of them, layer-by-layer methods solve each layer on one rank and
broadcast it, and only the main rank's writer keeps what it is given.
"""

from __future__ import annotations

import functools
import logging
import resource
import time
from pathlib import Path
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from compress.checkpoints.experts import routing_modules
from compress.checkpoints.shards import ShardedWriter
from compress.formats.base import PackedLayer, PackFormat
from compress.engine.journal import BlockJournal
from compress.engine.methods.base import LayerReport, Method
from compress.engine.ranks import Ranks, Replay, solve_on_owners
from compress.engine.activations import Activations
from compress.engine.checks import check_calibration, check_stages
from compress.engine.outcomes import LayerOutcomes
from compress.engine.outer import write_outer
from compress.engine.passes import (
    CallOrder, CallsDiverged, call_order, capture_block_inputs, propagate, run_block, run_until_called,
)
from compress.checkpoints.model_io import ModelHandle
from compress.engine.one_pass import (
    Prologue, first_group_reading, first_window, fused_stages, memory_for_one_pass, one_pass_batch, one_pass_capable,
    solve_while_propagating, window_chunks, windows_of, windows_per_chunk,
)
from compress.engine.reference import ReferenceStream
from compress.engine.stages import BlockObserver, EngineResult, Stage  # noqa: F401 - imported from here too
from compress.engine.statistics import Stat, StatsCollector, collect_statistics, expert_tokens

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]  # (phase, done, total)
LayerFn = Callable[[LayerReport], None]  # called as each layer is finished


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Engine:
    def __init__(
        self,
        handle: ModelHandle,
        stages: list[Stage],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 8,
        progress: ProgressFn | None = None,
        on_layer: LayerFn | None = None,
        packer: PackFormat | None = None,
        keep_final_hidden: bool = False,
        observer: BlockObserver | None = None,
        all_experts: bool = True,
        ranks: Ranks | None = None,
        activation_memory: int | None = None,
        scratch: Path | None = None,
        outer_weights: dict[str, torch.Tensor] | None = None,
        window_chunks: bool = False,
    ):
        """``packer``: the output format that writes each quantized layer's codes (None: dense weights).
        ``keep_final_hidden``: return the compressed last block's outputs on the calibration data (the
        output layer's inputs, before the final norm), for a caller calibrating the output layer.
        ``observer``: watches every compressed block's run on the calibration data (e.g. the KV-cache
        statistics); with one, calibration inputs are captured even if no method needs them.
        ``ranks``: the processes sharing this run (default: this one alone). ``activation_memory``: bytes of
        block inputs kept in memory, the rest in a file in ``scratch`` (default: all in memory).
        ``outer_weights``: parameters outside the blocks as the compressed model will hold them (a GGUF file's
        rounded embeddings), by name: the compressed model's block-0 inputs are captured with them, the
        uncompressed model's (asymmetric calibration) with the checkpoint's. ``window_chunks``: run the one pass's
        windows in chunks taking turns (`compress.engine.one_pass.window_chunks`), and the passes that run batch by
        batch in batches of that size (`pass_batch`); it pays only where the process's allocator serves a chunk's
        temporaries from its heap, where the next chunk reuses them (`compress.cli.allocator.CALIBRATING`)."""
        self.outer_weights = outer_weights or {}
        self.window_chunks = window_chunks
        self.handle = handle
        self.activation_memory = activation_memory
        self.scratch = scratch
        self.ranks = ranks or Ranks()
        self.observer = observer
        self.all_experts = all_experts  # MoE: calibrate every expert on every token (outputs stay routed)
        self.keep_final_hidden = keep_final_hidden
        self.outcomes = LayerOutcomes(packer)  # each layer's codes, written packed or dense
        self.stages = stages
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.progress = progress or (lambda phase, done, total: None)
        self.on_layer = on_layer or (lambda report: None)
        methods = [method for stage in stages for method in stage.methods()]
        self.needs_data = any(method.needs or method.block_inputs for method in methods) or observer is not None
        # asymmetric calibration, a method fitting blocks to float outputs: the uncompressed model's block inputs
        # travel beside the compressed model's
        self.needs_reference = any(Stat.INPUT_DRIFT in method.needs or method.block_inputs for method in methods)
        self.reference: ReferenceStream | None = None
        self._block_names = [handle.block_name(i) for i in range(len(handle.blocks))]
        self._call_orders: dict[tuple, CallOrder] = {}  # (block class, selected layers) -> relative names, see _call_order
        self._uncut: set[type] = set()  # block classes whose one-batch arguments do not cut into windows (_one_pass)
        self._in_blocks = tuple(name + "." for name in self._block_names)
        self._one_pass_stage = self._stage_for_one_pass()

    def _stage_for_one_pass(self) -> Stage | None:
        """The run's last stage, when its statistics and solves can ride the propagation pass (`compress.engine.
        one_pass`; the stages before it transform each block first, pass by pass: SmoothQuant before GPTQ): no
        reference stream or observer beside the pass, no routed experts (inputs differ per expert)."""
        if not self.stages or self.observer is not None or self.needs_reference:
            return None
        stage = self.stages[-1]
        return stage if one_pass_capable(stage.methods()) and not routing_modules(self.handle.model) else None

    def capture_batch(self, windows: torch.Tensor) -> int:
        """Windows per captured batch: all of them when one pass may solve the blocks and fits in memory
        (`--activation-memory`, else `memory_for_one_pass`), else `pass_batch`."""
        stage = self._one_pass_stage
        if stage is None:
            return self.pass_batch(windows)
        if windows.shape[0] <= self.batch_size:  # one batch already: the one pass
            return self.batch_size
        allowed = self.activation_memory if self.activation_memory is not None else memory_for_one_pass(self.device)
        fits = one_pass_batch(stage.layers, windows, self.handle.model.config, self.dtype, allowed)
        return windows.shape[0] if fits else self.pass_batch(windows)

    def pass_batch(self, windows: torch.Tensor) -> int:
        """Windows per batch of the passes that run batch by batch: ``batch_size``; with ``window_chunks`` on the CPU,
        at most `windows_per_chunk`, for the same heap as the one pass's chunks. AWQ's candidate forwards were
        system time: SmolLM2's first 2 blocks, 32 x 512 tokens, in batches of 8 under FRUGAL 58.4 s (12.2 M page faults,
        25.3 s of system time, peak RSS 1.17 GB); of 5 (this rule) under CALIBRATING 42.2 s (0.47 M, 1.4 s, 1.32 GB); of 8
        under CALIBRATING 48.9 s (5.2 M, 11.5 s, 1.43 GB): its MLP temporaries, 8 x 512 x 1536 floats, were still mapped."""
        if not self._heap_chunks():
            return self.batch_size
        layers = {name: module for stage in self.stages for name, module in stage.layers.items()}
        if not layers:
            return self.batch_size
        element = torch.empty((), dtype=self.dtype).element_size()
        return min(self.batch_size, windows_per_chunk(layers, windows.shape[1], element))

    def _heap_chunks(self) -> bool:
        """Whether windows run in heap-sized chunks: asked for (``window_chunks``) and on the CPU (they are for glibc's
        heap; a GPU's caching allocator reuses the whole batch's memory already)."""
        return self.window_chunks and self.device.type == "cpu"

    @property
    def packed(self) -> dict[str, PackedLayer]:
        """The layers written packed so far, for the format's config."""
        return self.outcomes.packed

    def check(self, calibration: torch.Tensor | None) -> None:
        """Validate every stage against every selected layer and the calibration windows before any work starts."""
        self.check_stages()
        self.check_calibration(calibration)

    def check_calibration(self, calibration: torch.Tensor | None) -> None:
        """The calibration windows are there when a method or the observer needs them, and enough for the ranks."""
        check_calibration(calibration, self.needs_data, self.stages, self.observer, self.ranks.world)

    def check_stages(self) -> None:
        """Validate every stage against every selected layer (what needs no calibration data: callers run it
        before tokenizing a calibration set)."""
        check_stages(self.stages, self.handle, self._in_blocks, self.all_experts, self.needs_reference)

    # -- 1. inputs of block 0 -------------------------------------------------------------------
    def new_activations(self) -> Activations:
        """An empty store for one block's calibration inputs, under the run's memory budget."""
        return Activations(self.activation_memory, self.scratch)

    def capture_inputs(self, calibration: torch.Tensor, weights: dict[str, torch.Tensor] | None = None) -> Activations:
        """Block 0's inputs for the ``calibration`` windows; ``weights``: parameters (full names) replacing the
        checkpoint's."""
        inputs = self.new_activations()
        batches = calibration.split(self.capture_batch(calibration))
        capture_block_inputs(self.handle, batches, self.device, self.dtype, weights or {}, inputs.append, self.progress)
        return inputs

    # -- 2. blocks --------------------------------------------------------------------------------
    def _run_block(self, block: nn.Module, inputs) -> list[torch.Tensor]:
        return run_block(block, inputs)

    def _propagate(self, block: nn.Module, inputs: Activations) -> Activations:
        """The next block's inputs: ``block``'s outputs on ``inputs`` (whose disk copy goes)."""
        outputs = self.new_activations()
        propagate(block, inputs, outputs)
        inputs.close()
        return outputs

    def _run_until_called(self, block: nn.Module, inputs, layers: dict[str, nn.Module], before_batch=None) -> None:
        run_until_called(block, inputs, layers, before_batch)

    def start_reference(self, inputs: Activations) -> None:
        """Carry the uncompressed model's block inputs from ``inputs`` on (asymmetric calibration)."""
        self.reference = ReferenceStream(inputs, self.new_activations)

    def _compress_block(self, index: int, inputs, stages: list[Stage] | None = None) -> list[LayerReport]:
        """Block ``index`` compressed pass by pass by ``stages`` (all the run's by default), one after the other."""
        block, block_name = self.handle.blocks[index], self._block_names[index]
        reports = []
        routing = routing_modules(block)
        for module in routing.values():
            module.calibrate_all_experts = self.all_experts
        if self.reference is not None:
            self.reference.start(block_name, block)
        stages = self.stages if stages is None else stages
        fused = self._fused(stages, block, block_name) if not routing else None
        if fused is not None:  # the earlier stages' groups between the last stage's, as in the one pass (`_one_pass`)
            reports += self._solve_upfront(fused[0], block, block_name, inputs)
            stages = stages[-1:]
        for stage in stages:
            layers = {n: m for n, m in stage.layers.items() if n.startswith(block_name + ".")}
            if not layers:
                continue
            sequential = stage.method.sequential and stage.method.needs
            order = self._call_order(block, block_name, layers, inputs) if stage.method.needs else None
            for group in order.groups if sequential else [layers]:
                for earlier, _, _, readers in fused[1] if fused is not None else []:
                    if group is first_group_reading(order.groups, readers):  # a statistics pass up to the readers
                        needs = earlier.readers_needs(block, block_name, readers)
                        collector = self._collect(block, inputs, readers, needs, routing, [list(readers)])
                        reports += self._solve_group(earlier, block, block_name, readers, collector, routing, inputs)
                read = stage.layers_read(block, block_name, group)
                needs = stage.needs_of(read)
                collector = self._collect(block, inputs, read, needs, routing, order.same_input if needs else [])
                reports += self._solve_group(stage, block, block_name, group, collector, routing, inputs)
        return reports

    def _solve_group(self, stage: Stage, block: nn.Module, block_name: str, group: dict[str, nn.Module],
                     collector: StatsCollector, routing: dict, inputs) -> list[LayerReport]:
        """Transform ``group``'s layers from the statistics ``collector`` holds (this rank's; combined here)."""
        collector.combine(self.ranks)
        stats = collector.results()
        tokens = expert_tokens(block_name, routing, collector, self.ranks) if collector.needs else {}
        replay = Replay(lambda: self._run_block(block, inputs), self.ranks, inputs, self.reference)  # methods that measure outputs
        reports = []
        for method, part in stage.split(group):
            parallel = self.ranks.world > 1 and method.layerwise
            solve = functools.partial(solve_on_owners, self.ranks) if parallel else self._solve
            for report in solve(method, block, part, {n: stats.get(n, {}) for n in part}, replay):
                report.info.update(tokens.get(report.name, {}))
                self.on_layer(report)
                reports.append(report)
            self.outcomes.keep(method, part)
        return reports

    def _one_pass(self, index: int, inputs: Activations, wanted: bool = True) -> tuple[list[LayerReport], Activations] | None:
        """Block ``index`` compressed in the pass that propagates its inputs: its reports and outputs (none unless
        ``wanted``: the pass then ends with the last group's solve); None where that cannot be (batches not
        captured as one, layers called other than once). Should the block call its layers otherwise than its
        structure's first block, its weights are read again and None returned: the caller compresses it pass by
        pass."""
        stage, block, block_name = self._one_pass_stage, self.handle.blocks[index], self._block_names[index]
        layers = {n: m for n, m in stage.layers.items() if n.startswith(block_name + ".")} if stage else {}
        if not layers or len(inputs) != 1:
            return None
        windows, seq_len = inputs[0][0].shape[:2]
        try:  # the call order from one window: a fraction of a forward pass over all of them
            order = self._call_order(block, block_name, layers, [first_window(inputs[0], windows)])
        except (RuntimeError, ValueError, IndexError) as exc:  # an argument cut where it should not have been
            log.debug("%s: call order from every window (%s)", block_name, exc)
            self._uncut.add(type(block))
            order = self._call_order(block, block_name, layers, inputs)
        if not order.once:
            return None
        # chunks of windows where asked for and the arguments cut (and no argument of the sequence's length looks like
        # the windows')
        cut = self._heap_chunks() and type(block) not in self._uncut and windows != seq_len
        parts = window_chunks(layers, windows, seq_len, inputs[0][0].element_size()) if cut else [slice(0, windows)]
        chunks = [windows_of(inputs[0], windows, part) for part in parts] if len(parts) > 1 else [inputs[0]]
        fused = self._fused(self.stages, block, block_name)
        if fused is None:  # the stages before run pass by pass, by chunk
            earlier, prologues = self._compress_block(index, chunks, self.stages[:-1]), []
        else:  # inside the pass: their layers without statistics first, then each group as its producer is reached
            earlier = self._solve_upfront(fused[0], block, block_name, inputs)
            prologues = [Prologue(name, module, readers, functools.partial(
                self._solve_produced, earlier_stage, block, block_name, readers, inputs))
                for earlier_stage, name, module, readers in fused[1]]
        needs_of = stage.needs_of
        solve_group = functools.partial(self._solve_group, stage, block, block_name, routing={}, inputs=inputs)
        try:
            reports, hidden = solve_while_propagating(block, chunks, order, needs_of, solve_group, prologues, through=wanted)
            reports = earlier + reports
        except CallsDiverged as exc:  # (the earlier stages run again on the weights read again)
            log.warning("%s: compressing pass by pass (%s)", block_name, exc)
            self.handle.materialize(block, block_name, self.device, self.dtype)
            return None
        outputs = self.new_activations()
        if hidden is not None:
            outputs.append(hidden, *inputs[0][1:])
        return reports, outputs

    def _fused(self, stages: list[Stage], block: nn.Module, block_name: str):
        """`one_pass.fused_stages` of the stages before the last, where the last may ride the one pass (true-sequential,
        layer by layer): SmoothQuant's groups then run between GPTQ's, in the one pass or pass by pass alike."""
        if len(stages) < 2 or not one_pass_capable(stages[-1].methods()):
            return None
        solved = {n: m for n, m in stages[-1].layers.items() if n.startswith(block_name + ".")}
        return fused_stages(stages[:-1], block, block_name, solved)

    def _solve_upfront(self, parts: list, block: nn.Module, block_name: str, inputs) -> list[LayerReport]:
        """The fused earlier stages' layers that read no statistics (`one_pass.fused_stages`), before any pass."""
        return [report for stage, part in parts for report in
                self._solve_group(stage, block, block_name, part, StatsCollector(part, frozenset()), {}, inputs)]

    def _solve_produced(self, stage: Stage, block: nn.Module, block_name: str, readers: dict[str, nn.Module], inputs,
                        outputs: list[torch.Tensor]) -> list[LayerReport]:
        """An earlier stage's group inside the one pass (`one_pass.Prologue`), from its producer's ``outputs``."""
        collector = StatsCollector(readers, stage.readers_needs(block, block_name, readers), [list(readers)])
        for y in outputs:  # the chunks in order; every reader is fed the very same tensor
            for name in readers:
                collector.feed(name, y)
        return self._solve_group(stage, block, block_name, readers, collector, {}, inputs)

    @staticmethod
    def _solve(method: Method, block: nn.Module, layers: dict[str, nn.Module], stats, replay) -> list[LayerReport]:
        return method.transform_block(block, layers, stats, replay=replay)

    def _call_order(self, block: nn.Module, block_name: str, layers: dict[str, nn.Module], inputs) -> CallOrder:
        """``layers``' `CallOrder` (full names), learned by one batch through the first block of each structure
        (block class and selected layers): blocks built alike call their layers alike."""
        relative = [name[len(block_name) + 1 :] for name in layers]
        key = (type(block), tuple(relative))
        if key not in self._call_orders:
            self._call_orders[key] = self._forward_order(block, {r: layers[f"{block_name}.{r}"] for r in relative}, inputs[0])
        order = self._call_orders[key]
        return CallOrder(
            [{f"{block_name}.{r}": layers[f"{block_name}.{r}"] for r in group} for group in order.groups],
            [[f"{block_name}.{r}" for r in names] for names in order.same_input],
            order.once,
        )

    def _forward_order(self, block: nn.Module, layers: dict[str, nn.Module], sample) -> CallOrder:
        return call_order(layers, lambda: self._run_block(block, [sample]))

    def _collect(self, block: nn.Module, inputs, group: dict[str, nn.Module], needs, routing: dict, same_input) -> StatsCollector:
        reference = self.reference if Stat.INPUT_DRIFT in needs else None

        def start_pass() -> None:
            for module in routing.values():
                module.reset_routed_tokens()
            if needs:
                paired = functools.partial(reference.run_batch, layers=group) if reference is not None else None
                self._run_until_called(block, inputs, group, paired)

        def any_rank(diverged: bool) -> bool:  # all ranks keep or drop the sharing alike (same collectives)
            return self.ranks.sum_floats(float(diverged))[0] > 0 if self.ranks.world > 1 else diverged

        return collect_statistics(group, needs, same_input, start_pass, any_rank, reference.input_of if reference else None)

    def run(self, writer: ShardedWriter, calibration: torch.Tensor | None = None, journal: BlockJournal | None = None) -> EngineResult:
        """``journal``: records the progress after each written block, and continues a killed run it recorded."""
        self.check(calibration)
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        result = EngineResult()
        resumed = journal.restore(self, writer) if journal is not None else None
        if resumed is not None:
            first, inputs, result.layers = resumed
        else:
            share = self.ranks.local_share(calibration) if self.needs_data else None
            first, inputs = 0, self.capture_inputs(share, self.outer_weights) if self.needs_data else self.new_activations()
            if self.needs_reference:
                self.start_reference(self.capture_inputs(share) if self.outer_weights else inputs.copy(self.new_activations()))
        blocks = self.handle.blocks
        for i in range(first, len(blocks)):
            block, name = blocks[i], self._block_names[i]
            original = self.handle.materialize(block, name, self.device, self.dtype)
            if i + 1 < len(blocks):  # read from the disk while this block is worked on
                self.handle.prefetch(blocks[i + 1], self._block_names[i + 1])
            else:
                self.handle.prefetch(self.handle.model, "", self.handle.non_block_parameters(self.handle.model))
            wanted = i + 1 < len(blocks) or self.keep_final_hidden or self.observer is not None  # its outputs
            solved = self._one_pass(i, inputs, wanted)
            if solved is not None:  # compressed while propagating
                result.layers += solved[0]
                inputs.close()
                inputs = solved[1]
            else:
                result.layers += self._compress_block(i, inputs)
            if self.reference is not None and (i + 1 < len(blocks) or self.keep_final_hidden):
                self.reference.advance()
            if solved is None and self.needs_data and wanted:  # the next block's inputs
                with self.observer.watch(name, block) if self.observer is not None else nullcontext():
                    inputs = self._propagate(block, inputs)
                if self.observer is not None:
                    self.observer.combine(self.ranks)
            self.outcomes.write_block(writer, name, block, original)
            self.handle.release(block)
            if journal is not None:
                journal.block_done(i, self, writer, inputs, result.layers)
            self.progress("blocks", i + 1, len(blocks))
        result.layers += self._write_outer(writer)
        if self.keep_final_hidden and self.needs_data:
            result.final_hidden = [h for h, _, _ in inputs]
            if self.reference is not None:
                result.final_reference = [h for h, _, _ in self.reference.inputs]
        inputs.close()
        if self.reference is not None:
            self.reference.close()
        result.blocks = len(blocks)
        result.seconds = time.perf_counter() - start
        result.peak_rss_bytes = peak_rss_bytes()
        if self.device.type == "cuda":
            result.peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
        return result

    def _write_outer(self, writer: ShardedWriter) -> list[LayerReport]:
        """3. Everything outside the blocks (`compress.engine.outer`): its transformed layers' reports."""
        return write_outer(self.handle, self.stages, self._in_blocks, self.outcomes, writer, self.device, self.dtype,
                           self.on_layer)
