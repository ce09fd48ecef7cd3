"""The forward passes the engine runs a decoder block through, and what they learn on the way.

- `capture_block_inputs`: block 0's inputs, with `InputCatcher` standing in for block 0 to stop the model's
  forward pass there.
- `run_block`: the block's outputs on every calibration batch (propagation, and methods' replays).
- `run_until_called`: a statistics pass that stops once the layers it collects for have run; `inputs_of`: the
  inputs a batch feeds some layers, from such a pass.
- `run_solving`: true-sequential in one pass: each group of layers transformed just before it runs, the
  block's output the transformed block's (the windows in chunks taking turns, `compress.engine.turns`).
- `call_order`: the block's layers grouped in call order, and the sets of them fed the very same tensor.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from compress.engine.turns import take_turns


class StopForward(Exception):
    """Raised inside a forward pass to end it early (caught by whoever started the pass)."""


class CallsDiverged(Exception):
    """A block called its layers otherwise than the `CallOrder` learned on its structure's first block."""


class InputCatcher(nn.Module):
    """Stands in for block 0: records its call and stops the forward pass."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls: list[tuple[tuple, dict[str, Any]]] = []

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # models may read attributes of their layers (e.g. attention type)
            return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        raise StopForward


def split_hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor, tuple, dict]:
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), (), kwargs


def capture_block_inputs(handle, batches: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                         weights: dict[str, torch.Tensor], append: Callable, progress: Callable) -> None:
    """Block 0's inputs for each batch of windows' token ids, handed to ``append(hidden, args, kwargs)``: the model's
    base (of the `ModelHandle` ``handle``) runs with only its weights outside the blocks materialized, ``weights``
    (full names) replacing the checkpoint's, and stops at block 0 (`InputCatcher`)."""
    base = handle.base_model
    outer = set(handle.non_block_parameters(base))
    handle.materialize(base, handle.base_prefix, device, dtype, only=outer)  # embeddings, positions, norms
    for name, tensor in weights.items():
        handle.model.get_parameter(name).data = tensor.to(device, dtype)
    catcher = InputCatcher(handle.blocks[0])
    handle.blocks[0] = catcher
    try:
        with torch.inference_mode():
            for i, batch in enumerate(batches):
                try:
                    base(input_ids=batch.to(device), use_cache=False)
                except StopForward:
                    pass
                args, kwargs = catcher.calls.pop()
                append(*split_hidden(args, kwargs))
                progress("calibration", i + 1, len(batches))
    finally:
        handle.blocks[0] = catcher.inner
        handle.release(base, only=outer)


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """A layer's input as a forward pre-hook (``with_kwargs=True``) sees it: the first argument, positional or not."""
    return args[0] if args else next(iter(kwargs.values()))


def block_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def run_block(block: nn.Module, inputs) -> list[torch.Tensor]:
    """``block``'s output hidden states for each ``(hidden, args, kwargs)`` calibration batch."""
    with torch.inference_mode():
        return [block_output(block(h, *args, **kwargs)) for h, args, kwargs in inputs]


def propagate(block: nn.Module, inputs, into) -> None:
    """Append ``block``'s output for each calibration batch to ``into`` (`Activations`), with the batch's other
    arguments: the next block's inputs, produced one batch at a time."""
    with torch.inference_mode():
        for h, args, kwargs in inputs:
            into.append(block_output(block(h, *args, **kwargs)), args, kwargs)


def run_until_called(block: nn.Module, inputs, layers: dict[str, nn.Module],
                     before_batch: Callable[[int], None] | None = None) -> None:
    """Run ``block`` on every calibration batch only until each of ``layers`` has been called: nothing
    after their last call can change their inputs, so a statistics pass for q/k/v stops before the
    attention, one for gate/up before the MLP's down projection (true-sequential's 4 passes cost ~2).
    The pass ends as the last of them is called, before it computes anything: a pass is for the layers'
    inputs, which pre-hooks registered before this one (`StatsCollector`'s, `inputs_of`'s) have then seen
    (a down projection's pass skips the down projection, SmoothQuant's skips the up projection and all after it).
    ``before_batch(k)`` is called before batch ``k`` runs."""
    pending: set[str] = set()

    def called(name: str):
        def hook(_module, _args):
            pending.discard(name)
            if not pending:
                raise StopForward

        return hook

    handles = [module.register_forward_pre_hook(called(name)) for name, module in layers.items()]
    try:
        with torch.inference_mode():
            for k, (h, args, kwargs) in enumerate(inputs):
                if before_batch is not None:
                    before_batch(k)
                pending.update(layers)
                try:
                    block(h, *args, **kwargs)
                except StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()


def inputs_of(block: nn.Module, batch, layers: dict[str, nn.Module]) -> dict[str, list[torch.Tensor]]:
    """The input of each call of ``layers`` while one ``(hidden, args, kwargs)`` batch runs through ``block``,
    until each has been called (as `run_until_called`)."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}

    def keep(name: str):
        def hook(_module, args, kwargs):
            seen[name].append(layer_input(args, kwargs))

        return hook

    handles = [module.register_forward_pre_hook(keep(name), with_kwargs=True) for name, module in layers.items()]
    try:
        run_until_called(block, [batch], layers)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def run_solving(block: nn.Module, chunks: list, groups: list[dict[str, nn.Module]],
                solve: Callable[[int, list[torch.Tensor]], None], through: bool = True) -> torch.Tensor | None:
    """``block``'s output on the calibration windows, given as ``chunks`` of ``(hidden, args, kwargs)`` batches, each
    of ``groups`` (a `CallOrder`'s, every layer called once) transformed by ``solve(k, xs)`` just before its first
    layer runs, ``xs`` the input each chunk is about to feed the group, in order. Each group's input is then computed
    with the groups before it transformed, which is what true-sequential's statistics pass for that group sees
    (`run_until_called`), and the output (the chunks' outputs joined) is the transformed block's (the propagation):
    one forward pass where the passes cost about 2 and propagation 1. Several chunks take turns
    (`compress.engine.turns`): each runs until it reaches a group and hands over; the last to arrive solves the group.
    With ``through`` False nothing reads the output (the last block): each chunk stops as the last group is
    transformed, before it runs (the last block's down projection on every window), and None is returned.
    Raises `CallsDiverged` when a layer is not fed its group's input, called twice or never."""
    where = {name: (k, j) for k, group in enumerate(groups) for j, name in enumerate(group)}
    arrived: list[list[torch.Tensor | None]] = [[None] * len(chunks) for _ in groups]  # each chunk's input of group k
    solved = [False] * len(groups)
    fed: list[dict[int, torch.Tensor]] = [{} for _ in chunks]  # each chunk's input of each group it has reached
    called: list[set[str]] = [set() for _ in chunks]  # the layers each chunk has called
    running: list = [None]  # the `Turns` the chunks take, which knows the chunk running now

    def hook_for(name: str):
        k, position = where[name]

        def hook(_module, args, kwargs):
            turns = running[0]
            x, chunk = layer_input(args, kwargs), turns.current
            if name in called[chunk] or (position > 0 and fed[chunk].get(k) is not x):
                raise CallsDiverged(f"{name} was called twice or not on its group's input")
            called[chunk].add(name)
            if position:
                return
            fed[chunk][k] = arrived[k][chunk] = x
            if all(a is not None for a in arrived[k]):  # the last chunk to get here
                solve(k, arrived[k])
                solved[k], arrived[k] = True, []
            else:
                turns.hand_over(chunk)
                if not solved[k]:  # every other chunk has finished without reaching the group
                    raise CallsDiverged(f"{name} was not called on every chunk of windows")
            if not through and k == len(groups) - 1:
                raise StopForward

        return hook

    def run_chunk(turns, chunk: int) -> torch.Tensor:
        running[0] = turns
        h, args, kwargs = chunks[chunk]
        try:
            out = block_output(block(h, *args, **kwargs))
        except StopForward:
            return None
        if len(called[chunk]) != len(where):
            raise CallsDiverged(f"{sorted(set(where) - called[chunk])[0]} was never called")
        fed[chunk].clear()  # the chunk's group inputs, no longer needed
        return out

    handles = [module.register_forward_pre_hook(hook_for(name), with_kwargs=True)
               for group in groups for name, module in group.items()]
    try:
        with torch.inference_mode():  # around the turns, not inside a chunk: the chunks share the thread's modes
            outputs = take_turns([run_chunk] * len(chunks))
    finally:
        for handle in handles:
            handle.remove()
    if not through:
        return None
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


@dataclass(frozen=True)
class CallOrder:
    """How one batch through a block calls its layers (relative names).

    ``groups``: the layers in call order, those called in a row on the very same input tensor (q/k/v,
    gate/up) together, then any never called. ``same_input``: sets of two or more layers fed the very same
    tensor anywhere in the pass (q/k/v, gate/up, and every expert's gate/up when all experts calibrate):
    their input statistics are the same, so they are collected once (`StatsCollector`). ``once``: every layer
    was called exactly once (what `run_solving` needs)."""

    groups: list[list[str]]
    same_input: list[list[str]]
    once: bool = True


def call_order(layers: dict[str, nn.Module], run_sample: Callable[[], Any]) -> CallOrder:
    """The `CallOrder` of ``layers`` (names as given) in one ``run_sample()`` (one batch through their block)."""
    calls: list[tuple[str, torch.Tensor]] = []  # holding the inputs keeps their identities unique
    hooks = [
        module.register_forward_pre_hook(
            lambda _m, args, kwargs, n=name: calls.append((n, layer_input(args, kwargs))),
            with_kwargs=True,
        )
        for name, module in layers.items()
    ]
    try:
        run_sample()
    finally:
        for h in hooks:
            h.remove()
    groups: list[list[str]] = []
    by_input: dict[int, list[str]] = {}  # id of an input tensor (alive in ``calls``) -> the layers it fed
    first_input: dict[str, torch.Tensor] = {}
    last_input = None
    for name, x in calls:
        if name in first_input:
            continue
        if groups and x is last_input:
            groups[-1].append(name)
        else:
            groups.append([name])
        first_input[name] = last_input = x
        by_input.setdefault(id(x), []).append(name)
    # A layer called on several inputs belongs to no set: sharing is for layers whose every call matches.
    repeated = {name for name, count in collections.Counter(n for n, _ in calls).items() if count > 1}
    same_input = [names for names in by_input.values() if len(names) > 1 and not repeated & set(names)]
    uncalled = [n for n in layers if n not in first_input]
    return CallOrder(groups + ([uncalled] if uncalled else []), same_input, not repeated and not uncalled)
