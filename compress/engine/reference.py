"""The uncompressed model's view of the calibration data, carried beside the compressed model's.

Asymmetric calibration (`compress.quantizers.asymmetric`, the INPUT_DRIFT statistic) compares each layer's
input in the compressed model ``x`` with the same token's input in the original model ``x_f``. The engine
propagates only the compressed model's block inputs; a `ReferenceStream` keeps the original model's: for each
block an untouched copy of it (taken before any method changes it), run on the original inputs batch by batch
beside the engine's statistics passes, and after the block its outputs on them, the next block's original
inputs. It costs one more copy of the block inputs and of one block's weights, and one more forward pass of
the original block per statistics pass and per block.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from compress.engine.activations import Activations
from compress.engine.passes import inputs_of, propagate, run_block


class ReferenceStream:
    """``inputs``: the current block's inputs in the uncompressed model (an `Activations` of its own);
    ``new_activations()`` makes the store of the next block's."""

    def __init__(self, inputs: Activations, new_activations: Callable[[], Activations]):
        self.inputs = inputs
        self._new = new_activations
        self._block: nn.Module | None = None
        self._block_name = ""
        self._seen: dict[str, list[torch.Tensor]] = {}

    def start(self, block_name: str, block: nn.Module) -> None:
        """Keep an untouched copy of ``block`` (call before any method transforms it)."""
        self._block, self._block_name = copy.deepcopy(block), block_name

    def run_batch(self, index: int, layers: dict[str, nn.Module]) -> None:
        """Run the original block on batch ``index`` until ``layers`` (the compressed block's, full names) were
        called, keeping their inputs for `input_of`."""
        prefix = len(self._block_name) + 1
        originals = {name: self._block.get_submodule(name[prefix:]) for name in layers}
        self._seen = inputs_of(self._block, self.inputs[index], originals)

    def input_of(self, name: str) -> torch.Tensor:
        """The original model's input to ``name`` for its next call in the batch being run."""
        calls = self._seen.get(name)
        if not calls:
            raise ValueError(f"{name} was called more often than in the uncompressed model")
        return calls.pop(0)

    def outputs(self) -> list[torch.Tensor]:
        """The untouched block's outputs on the original inputs, batch by batch: the uncompressed model's."""
        return run_block(self._block, self.inputs)

    def advance(self) -> None:
        """Move on to the next block: its original inputs are this block's original outputs."""
        outputs = self._new()
        propagate(self._block, self.inputs, outputs)
        self.inputs.close()
        self.inputs, self._block, self._seen = outputs, None, {}

    def close(self) -> None:
        self.inputs.close()
        self._block, self._seen = None, {}
