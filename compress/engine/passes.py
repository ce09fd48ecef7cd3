"""The forward passes the engine runs a decoder block through, and what they learn on the way.

- `InputCatcher` stands in for block 0 and stops the model's forward pass there: block 0's inputs.
- `run_block`: the block's outputs on every calibration batch (propagation, and methods' replays).
- `run_until_called`: a statistics pass that stops once the layers it collects for have run.
- `forward_groups`: the block's layers grouped in call order, those fed the very same tensor together.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class StopForward(Exception):
    """Raised inside a forward pass to end it early (caught by whoever started the pass)."""


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


def run_until_called(block: nn.Module, inputs, layers: dict[str, nn.Module]) -> None:
    """Run ``block`` on every calibration batch only until each of ``layers`` has been called: nothing
    after their last call can change their inputs, so a statistics pass for q/k/v stops before the
    attention, one for gate/up before the MLP's down projection (true-sequential's 4 passes cost ~2)."""
    pending: set[str] = set()

    def called(name: str):
        def hook(_module, _args, _output):
            pending.discard(name)
            if not pending:
                raise StopForward

        return hook

    handles = [module.register_forward_hook(called(name)) for name, module in layers.items()]
    try:
        with torch.inference_mode():
            for h, args, kwargs in inputs:
                pending.update(layers)
                try:
                    block(h, *args, **kwargs)
                except StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()


def forward_groups(layers: dict[str, nn.Module], run_sample: Callable[[], Any]) -> list[dict[str, nn.Module]]:
    """Split ``layers`` into groups in the order ``run_sample()`` (one batch through their block) calls them;
    layers called in a row on the very same input tensor (q/k/v, gate/up) form one group; layers never
    called form a last group."""
    calls: list[tuple[str, torch.Tensor]] = []  # holding the inputs keeps their identities unique
    hooks = [
        module.register_forward_pre_hook(
            lambda _m, args, kwargs, n=name: calls.append((n, args[0] if args else next(iter(kwargs.values())))),
            with_kwargs=True,
        )
        for name, module in layers.items()
    ]
    try:
        run_sample()
    finally:
        for h in hooks:
            h.remove()
    groups: list[dict[str, nn.Module]] = []
    seen: set[str] = set()
    last_input = None
    for name, x in calls:
        if name in seen:
            continue
        if groups and x is last_input:
            groups[-1][name] = layers[name]
        else:
            groups.append({name: layers[name]})
        seen.add(name)
        last_input = x
    uncalled = {n: m for n, m in layers.items() if n not in seen}
    return groups + ([uncalled] if uncalled else [])
