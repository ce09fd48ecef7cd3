"""The one statistics module: what calibration inputs tell each method about a layer's input.

Every method declares the `Stat` kinds it needs; the engine attaches a `StatsCollector` to a block's
layers and collects exactly those, from the layer inputs ``x`` (``[..., in_features]``: 2-D or 3-D
activations, nn.Linear and GPT-2 Conv1D alike), as float64 sums of each window's float32 products
(see `InputStatistics`), so the figures do not depend on how calibration windows are batched or
shared among processes.

- HESSIAN: ``H = 2/n Σ x xᵀ`` over all n token vectors (``[in, in]``), the GPTQ/SparseGPT proxy Hessian.
- INPUT_L2: per-input-channel L2 norm ``‖X_j‖₂`` over all tokens (``[in]``), Wanda's activation norm.
- INPUT_ABSMAX: per-input-channel ``max |X_j|`` (``[in]``), SmoothQuant's activation range.
- INPUT_ABSMEAN: per-input-channel ``mean |X_j|`` (``[in]``), AWQ's activation salience.
- INPUT_DRIFT: ``Δ = 2/n Σ (x_f − x) xᵀ`` (``[in, in]``), ``x_f`` the same token's input of the layer in the
  uncompressed model (the engine's reference stream): asymmetric calibration (`compress.quantizers.asymmetric`).
"""

from __future__ import annotations

import enum
import logging
from contextlib import AbstractContextManager
from typing import Callable, Iterator

import torch
from torch import nn

from compress.engine.passes import layer_input
from compress.quantizers import gram

log = logging.getLogger(__name__)


class Stat(enum.Enum):
    HESSIAN = "hessian"
    INPUT_L2 = "input_l2"
    INPUT_ABSMAX = "input_absmax"
    INPUT_ABSMEAN = "input_absmean"
    INPUT_DRIFT = "input_drift"


class InputStatistics:
    """Running statistics of one layer's inputs, kept as float64 sums.

    Each calibration window's (each row of a 3-D input's) float32 products are added to float64 sums, so
    the figures do not depend on how windows are batched or shared among processes: float64 sums in any
    order round to the same float32 result (differing only where a sum lands within 1e-16 of a float32
    rounding boundary). A 2-D input (an MoE expert's routed tokens, gathered from several windows) has no
    window rows, so its products are taken in float64, exact for float32 inputs. GPTQ's column order
    follows the Hessian's diagonal, so last-bit differences there would change many codes. Contiguous bfloat16
    windows on a CPU that multiplies bfloat16 pairs take their Gram sums compiled (`compress.quantizers.gram`): each
    window's float32 sum in another order than torch's product, so such a run's codes differ from a float32 copy's
    as runs on CPUs of different float32 kernels do, and with no float32 copy of the input where the Hessian is all
    that is collected."""

    def __init__(self, in_features: int, needs: frozenset[Stat], device: torch.device | str = "cpu",
                 scratch: GramScratch | None = None):
        self.in_features = in_features
        self.needs = needs
        self.count = 0  # token vectors seen
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        # Σ x xᵀ, its upper triangle (and whatever lies below it in the diagonal blocks): see add_upper_gram_
        self.outer_sum = zeros(in_features, in_features) if Stat.HESSIAN in needs else None
        # add_upper_gram_'s buffers and the float32 copy of the input, reused window after window (``scratch``: shared
        # with the other layers' statistics of a pass, which are updated one at a time)
        self._scratch = scratch or GramScratch()
        self.sq_sum = zeros(in_features) if Stat.INPUT_L2 in needs else None  # Σ x²
        self.absmax = torch.zeros(in_features, device=device) if Stat.INPUT_ABSMAX in needs else None
        self.abs_sum = zeros(in_features) if Stat.INPUT_ABSMEAN in needs else None  # Σ |x|
        self.drift_sum = zeros(in_features, in_features) if Stat.INPUT_DRIFT in needs else None  # Σ (x_f − x) xᵀ

    def update(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        """Add the token vectors ``x``; ``reference``: the same tokens' input in the uncompressed model (INPUT_DRIFT)."""
        x = x.detach()
        if x.numel() == 0:
            return
        if self.drift_sum is not None and (reference is None or reference.shape != x.shape):
            got = "none" if reference is None else tuple(reference.shape)
            raise ValueError(f"the uncompressed model's input {got} does not match this input {tuple(x.shape)}")
        gram_done = False
        if self.outer_sum is not None and x.dim() >= 3:  # bfloat16 windows: compiled, where the CPU multiplies them
            windows = x.reshape(-1, x.shape[-2], self.in_features)
            if gram.usable(self.outer_sum, windows):
                packed = self._scratch.take(gram.packed_shape(windows), windows, torch.int32)
                gram.add_upper_gram_bf16_(self.outer_sum, windows, packed)
                gram_done = True
                if not self.needs - {Stat.HESSIAN}:  # nothing else to collect: no float32 copy
                    self.count += windows.shape[0] * windows.shape[1]
                    return
        x = self._scratch.float32_of(x)
        pairs = self._windows(x)
        if self.outer_sum is not None and pairs.shape[1] > 0 and not gram_done:
            add_upper_gram_(self.outer_sum, pairs, self._scratch)
        references = self._windows(reference.detach().float()) if self.drift_sum is not None else [None] * len(pairs)
        for window, ref in zip(pairs, references):
            if window.shape[0] == 0:
                continue
            if self.drift_sum is not None:
                self.drift_sum.add_((ref - window).t() @ window)
            if self.sq_sum is not None:
                self.sq_sum.add_(window.square().sum(dim=0))
            if self.absmax is not None:
                torch.maximum(self.absmax, window.abs().amax(dim=0).float(), out=self.absmax)  # exact: float32 values
            if self.abs_sum is not None:
                self.abs_sum.add_(window.abs().sum(dim=0))
            self.count += window.shape[0]

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 3:  # [..., seq_len, in]: one window per row, its products in float32
            return x.reshape(-1, x.shape[-2], self.in_features)
        # tokens of several windows in one matrix (MoE experts): exact float64 products, whatever the grouping
        return x.reshape(1, -1, self.in_features).double()

    def combine(self, ranks) -> None:
        """Replace this rank's statistics with those of all ranks' tokens (`compress.engine.ranks.Ranks`)."""
        held = [t for t in (self.outer_sum, self.sq_sum, self.absmax, self.abs_sum, self.drift_sum) if t is not None]
        if ranks.world == 1 or not held:
            return
        self.count = int(ranks.sum_(torch.tensor([float(self.count)], dtype=torch.float64, device=held[0].device)).item())
        for total in (self.outer_sum, self.sq_sum, self.abs_sum, self.drift_sum):
            if total is not None:
                ranks.sum_(total)
        if self.absmax is not None:
            ranks.max_(self.absmax)

    def release(self) -> None:
        """Drop the sums and buffers (after `result`): no further `update` or `result`."""
        self.outer_sum = self.sq_sum = self.absmax = self.abs_sum = self.drift_sum = None
        self._scratch = GramScratch()

    def result(self) -> dict[Stat, torch.Tensor]:
        """Each needed statistic, float32; ``H = 2/n Σ x xᵀ`` (zeros before any token)."""
        n = max(self.count, 1)
        out: dict[Stat, torch.Tensor] = {}
        if self.outer_sum is not None:
            out[Stat.HESSIAN] = symmetric_from_upper(self.outer_sum, 2.0 / n, torch.float32)
        if self.sq_sum is not None:
            out[Stat.INPUT_L2] = self.sq_sum.sqrt().float()
        if self.absmax is not None:
            out[Stat.INPUT_ABSMAX] = self.absmax
        if self.abs_sum is not None:
            out[Stat.INPUT_ABSMEAN] = (self.abs_sum / n).float()
        if self.drift_sum is not None:
            out[Stat.INPUT_DRIFT] = (self.drift_sum * (2.0 / n)).float()
        return out


# `symmetric_from_upper`: rows per strip (a 256-row strip of a float32 column block below the diagonal stays in cache)
MIRROR_ROWS = 256
# `_upper_blocks`: a triangle this wide or narrower is covered by row panels of GRAM_PANEL rows from the diagonal to
# its right edge (what falls below the diagonal is half of each panel's first square); wider ones split at a multiple
# of GRAM_ALIGN columns (whole vector registers) into two triangles and the square between them.
GRAM_LEAF, GRAM_PANEL, GRAM_ALIGN = 1536, 128, 64


def _upper_blocks(first: int, width: int) -> Iterator[tuple[slice, slice]]:
    """The blocks ``(rows, columns)`` covering the upper triangle of columns ``first .. first + width``: its two
    halves' triangles and the square between them, recursively, down to `GRAM_LEAF` wide, each leaf in row panels of
    `GRAM_PANEL` rows. The squares are the large products; the waste below the diagonal is half of each panel's
    first square, a twelfth of a 1536-wide triangle, where one square leaf per 384 columns would waste a quarter (5
    windows of 512 on one thread, against such leaves: 576 wide 15 -> 12 ms, 1536 wide 89 -> 80 ms, 2560 wide 221 -> 210
    ms, 4096 wide 556 -> 537 ms; every entry the same sum of the same window products, bit for bit). Narrower panels
    run below the products' rate, wider ones waste more."""
    if width <= GRAM_LEAF:
        for r in range(first, first + width, GRAM_PANEL):
            yield slice(r, min(r + GRAM_PANEL, first + width)), slice(r, first + width)
        return
    half = max(GRAM_ALIGN, (width // 2 + GRAM_ALIGN // 2) // GRAM_ALIGN * GRAM_ALIGN)
    yield from _upper_blocks(first, half)
    yield slice(first, first + half), slice(first + half, first + width)
    yield from _upper_blocks(first + half, width - half)


class GramScratch:
    """Buffers `add_upper_gram_` reuses from call to call: each block's float32 product and, for a float64 total,
    its float64 copy (a mixed-dtype ``add_`` runs at half the speed of a copy and a same-dtype add, and fresh
    blocks of hundreds of MB per window cost their page faults again each time); and `float32_of`'s copy of a
    half-precision input."""

    def __init__(self):
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._input: torch.Tensor | None = None

    def float32_of(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as float32: itself if it is, else its values in a buffer kept for the next call (valid until then). A
        fresh copy of a chunk of windows is a new mapping of tens of MB, page-faulted in at every input of every
        layer (SmolLM2's MLP down projection, bf16, 8 windows of 512: 25 MB); a non-contiguous ``x`` gets ``.float()``
        (its strides kept, as the products' operands)."""
        if x.dtype == torch.float32:
            return x
        if not x.is_contiguous():
            return x.float()
        buffer = self._input
        if buffer is None or buffer.numel() < x.numel() or buffer.device != x.device:
            buffer = self._input = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        return buffer[: x.numel()].view(x.shape).copy_(x)

    def take(self, shape: tuple[int, int], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        count = shape[0] * shape[1]
        flat = self._flat.get(dtype)
        if flat is None or flat.numel() < count or flat.device != like.device:
            flat = self._flat[dtype] = torch.empty(count, dtype=dtype, device=like.device)
        return flat[:count].view(shape)


def add_upper_gram_(total: torch.Tensor, x: torch.Tensor, scratch: GramScratch | None = None) -> None:
    """``total += Σ_w x_wᵀx_w`` over the windows ``x [windows, tokens, in]`` (or one, ``[tokens, in]``) on and above
    the diagonal, a block at a time (`_upper_blocks`): the Gram matrix is symmetric, so the blocks below are never
    multiplied or added, about half the work of the full product (collecting the Hessians is most of a GPTQ
    statistics pass). Read it with `symmetric_from_upper`. Each window's product is taken in ``x``'s dtype and added
    to ``total`` in window order, so every entry gets the same sums in the same order whether the windows come
    stacked or one call each; the windows run inside the loop over blocks, so each block of ``total`` stays in cache
    while their products are added to it (window outside: 1536 wide, 5 windows of 512, 51 -> 43 ms).
    ``scratch``: buffers kept between calls (the same sums, bit for bit)."""
    scratch = scratch or GramScratch()
    windows = x if x.dim() == 3 else x.unsqueeze(0)
    widen = total.dtype != x.dtype
    for rows, columns in _upper_blocks(0, windows.shape[-1]):
        block = total[rows, columns]
        # each window's product (and its float64 copy) in the same buffers: taken once per block
        product = scratch.take(block.shape, x, x.dtype)
        wide = scratch.take(block.shape, x, total.dtype) if widen else product
        for window in windows:
            torch.matmul(window[:, rows].t(), window[:, columns], out=product)
            block.add_(wide.copy_(product) if widen else product)


def symmetric_from_upper(total: torch.Tensor, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The symmetric matrix whose upper triangle `add_upper_gram_` filled (exactly symmetric), times ``scale``, in
    ``dtype`` (default ``total``'s). A strip of `MIRROR_ROWS` rows at a time: its part from the diagonal on is scaled
    (in ``total``'s precision) and rounded to ``dtype`` once, then written transposed into the columns below the
    diagonal, whose rows are then in cache. Every entry is written once, and nothing below ``total``'s diagonal is
    read (14336 wide, float64 to float32: 1.08 -> 0.45 s against scaling every row and adding a transposed copy,
    the same values)."""
    n = total.shape[0]
    out = torch.empty(total.shape, dtype=dtype or total.dtype, device=total.device)
    for r in range(0, n, MIRROR_ROWS):
        e = min(r + MIRROR_ROWS, n)
        strip = out[r:e, r:]
        strip.copy_(total[r:e, r:] * scale)
        out[e:, r:e] = strip[:, e - r :].t()
        square = strip[:, : e - r]  # the diagonal block: mirrored within
        square.copy_(square.triu() + square.triu(1).t())
    return out


def layer_in_features(module: nn.Module) -> int:
    """Input width of a Linear (``in_features``) or GPT-2 Conv1D (``weight [in, out]``)."""
    in_features = getattr(module, "in_features", None)
    if in_features is None:  # transformers' Conv1D stores weight as [in, out]
        in_features = module.weight.shape[0]
    return int(in_features)


class InputsDiverged(Exception):
    """Layers expected to share their input (`StatsCollector`'s ``same_input``) were fed different tensors."""


class _SharedInput:
    """One `InputStatistics` for layers fed the very same tensor: the first (leader) adds each input, every
    other layer must then be fed that very tensor once before the leader's next input."""

    def __init__(self, stats: InputStatistics, names: list[str]):
        self.stats, self.leader, self.followers = stats, names[0], frozenset(names[1:])
        self.last: torch.Tensor | None = None  # the leader's latest input
        self.claimed: set[str] = set(self.followers)  # followers fed ``last`` so far

    def feed(self, name: str, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        if name == self.leader:
            self.check_claimed()
            self.stats.update(x, reference)
            self.last, self.claimed = x, set()
        elif x is self.last and name not in self.claimed:  # identity: the tensor itself, not equal values
            self.claimed.add(name)
        else:
            raise InputsDiverged(f"{name} was fed another input than {self.leader}")

    def check_claimed(self) -> None:
        """Every follower was fed the leader's latest input."""
        if self.claimed != self.followers:
            raise InputsDiverged(f"{sorted(self.followers - self.claimed)} missed an input of {self.leader}")


class StatsCollector(AbstractContextManager):
    """Forward pre-hooks that feed each layer's input into its `InputStatistics`.

    ``same_input``: sets of layers fed the very same tensor (`compress.engine.passes.CallOrder`): each set
    accumulates one `InputStatistics` (q/k/v: a third of the Hessian work and memory). Should a set's
    layers ever be fed different tensors, the pass raises `InputsDiverged`; the caller collects again
    without sharing. ``reference(name)``: the layer's input in the uncompressed model for the batch being run
    (INPUT_DRIFT; `compress.engine.reference.ReferenceStream`)."""

    def __init__(self, layers: dict[str, nn.Module], needs: frozenset[Stat], same_input: list[list[str]] = (),
                 reference: Callable[[str], torch.Tensor] | None = None):
        self.needs = needs
        self._reference = reference if Stat.INPUT_DRIFT in needs else None
        self.stats: dict[str, InputStatistics] = {}
        self._shared: dict[str, _SharedInput] = {}
        self._scratch = GramScratch()  # one for every layer's statistics: the hooks feed them one at a time
        for names in same_input:
            names = [n for n in names if n in layers]
            if len(names) > 1:
                shared = _SharedInput(self._new(layers[names[0]]), names)
                self._shared.update(dict.fromkeys(names, shared))
                self.stats.update(dict.fromkeys(names, shared.stats))
        for name, module in layers.items():
            if name not in self.stats:
                self.stats[name] = self._new(module)
        self._layers = layers
        self._handles: list = []

    def _new(self, module: nn.Module) -> InputStatistics:
        return InputStatistics(layer_in_features(module), self.needs, module.weight.device, self._scratch)

    def feed(self, name: str, x: torch.Tensor) -> None:
        """Add ``x``, an input of layer ``name`` (what each forward pre-hook does)."""
        shared = self._shared.get(name)
        reference = self._reference(name) if self._reference is not None else None
        shared.feed(name, x, reference) if shared is not None else self.stats[name].update(x, reference)

    def _feeder(self, name: str):
        def hook(_module, args, kwargs):
            self.feed(name, layer_input(args, kwargs))

        return hook

    def __enter__(self) -> "StatsCollector":
        if self.needs:
            for name, module in self._layers.items():
                self._handles.append(module.register_forward_pre_hook(self._feeder(name), with_kwargs=True))
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        shared = list(dict.fromkeys(self._shared.values()))
        for s in shared:
            s.last = None  # release the activation
        if exc_type is None:
            for s in shared:
                s.check_claimed()

    def combine(self, ranks) -> None:
        """Every layer's statistics over all ranks' calibration tokens (`InputStatistics.combine`); a shared
        one once."""
        for stats in {id(s): s for s in self.stats.values()}.values():
            stats.combine(ranks)

    def results(self) -> dict[str, dict[Stat, torch.Tensor]]:
        """Each layer's statistics; layers sharing an input get the very same dict (computed once), which tells a
        method they can be solved together (`Method.transform_shared`): statistics are read-only to methods (the
        solvers work on copies). Taken once: the float64 sums are released after (with their buffers, 1.9 GB for a
        14336-wide layer, which would otherwise be held while the group is solved)."""
        done: dict[int, dict[Stat, torch.Tensor]] = {}
        out = {}
        for name, stats in self.stats.items():
            if id(stats) not in done:
                done[id(stats)] = stats.result()
                stats.release()
            out[name] = done[id(stats)]
        self._scratch = GramScratch()  # its buffers too: nothing is added after
        return out


def collect_statistics(layers: dict[str, nn.Module], needs: frozenset[Stat], same_input: list[list[str]],
                       run_pass: Callable[[], None], any_diverged: Callable[[bool], bool] = lambda d: d,
                       reference: Callable[[str], torch.Tensor] | None = None) -> StatsCollector:
    """A `StatsCollector` fed by ``run_pass()`` (the calibration batches through the layers' block), each set of
    ``same_input`` collected once; should a set's layers be fed different tensors (``any_diverged``: on any
    process), the pass runs again without sharing. ``reference``: as `StatsCollector`'s."""
    for shared in ([same_input, []] if same_input else [[]]):
        diverged = False
        try:
            with StatsCollector(layers, needs, shared, reference) as collector:
                run_pass()
        except InputsDiverged as exc:
            diverged = True
            log.debug("collecting again without shared statistics: %s", exc)
        if not shared or not any_diverged(diverged):
            return collector
    raise AssertionError("unreachable: the last attempt shares nothing")


class CallRecorder(AbstractContextManager):
    """Records every call of some modules during a forward pass: positional and keyword inputs, and
    the first output (methods that re-run a sub-module under candidate weights, like AWQ, replay these).

    Tensors are kept as they were passed (no copies): the caller owns the recording's memory.
    """

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules = modules
        self.calls: dict[str, list[tuple[tuple, dict, torch.Tensor]]] = {name: [] for name in modules}
        self._handles: list = []

    def __enter__(self) -> "CallRecorder":
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def _hook(self, name: str):
        def hook(_module, args, kwargs, output):
            first = output[0] if isinstance(output, (tuple, list)) else output
            self.calls[name].append((args, dict(kwargs), first))

        return hook

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def expert_tokens(block_name: str, routing: dict, collector: StatsCollector, ranks) -> dict[str, dict[str, int]]:
    """Per expert layer of the pass that collected ``collector``'s statistics: the tokens the router sent to its
    expert over every rank's share, and the tokens its statistics saw (all of them when every expert calibrates on
    every token). ``routing``: the block's routing modules by relative name."""
    counts = {}
    for prefix, module in routing.items():
        for relative, routed in module.routed_tokens().items():
            name = f"{block_name}.{prefix}.{relative}" if prefix else f"{block_name}.{relative}"
            if name in collector.stats:
                counts[name] = {"routed_tokens": routed, "calibration_tokens": collector.stats[name].count}
    if counts and ranks.world > 1:  # the statistics' counts are over every rank already
        for c, total in zip(counts.values(), ranks.sum_floats(*(c["routed_tokens"] for c in counts.values()))):
            c["routed_tokens"] = int(total)
    return counts
