"""What the quantizing stages leave of each layer, and how the engine writes it: packed codes or dense weights.

A method hands the engine each quantized layer's outcome (`Method.keep_outcome`: codes, scales, static input
scale); `LayerOutcomes` keeps the last quantizing stage's per layer (a later stage that re-quantizes only the
weights keeps an earlier stage's activation quantization), and when the layer's block is written asks the
output format for its packed tensors, writing it dense with a warning where the format cannot hold it or the
weight changed after it was quantized.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import torch
from torch import nn

from compress.checkpoints.model_io import get_weight, is_conv1d
from compress.checkpoints.shards import ShardedWriter
from compress.engine.methods.base import LayerOutcome, Method
from compress.formats.base import PackedLayer, PackFormat, has_trivial_g_idx

log = logging.getLogger(__name__)


class LayerOutcomes:
    """``packer``: the output format (None: every layer dense). ``packed``: the layers written packed so far."""

    def __init__(self, packer: PackFormat | None):
        self.packer = packer
        self.packed: dict[str, PackedLayer] = {}
        # last quantizing stage per layer: its outcome, its activation settings, and the layer's weight as the stage
        # left it (`untouched`)
        self._outcomes: dict[str, tuple[LayerOutcome, dict | None, tuple]] = {}

    def keep(self, method: Method, layers: dict[str, nn.Module]) -> None:
        """Remember the codes of the layers ``method`` just quantized; a layer changed by a later stage
        without new codes loses its earlier ones (it is written dense)."""
        kept = method.take_outcomes()
        activations = method.record().get("activations") if kept else None
        for name in layers:
            if name in kept:
                outcome, acts = kept[name], activations
                earlier = self._outcomes.get(name)
                if acts is None and earlier is not None and earlier[1]:
                    # Weights re-quantized after an activation-quantizing stage (SmoothQuant, then GPTQ):
                    # the layer keeps that stage's activation quantization and static input scale.
                    acts = earlier[1]
                    if outcome.input_scale is None:
                        outcome = dataclasses.replace(outcome, input_scale=earlier[0].input_scale)
                weight = layers[name].weight
                self._outcomes[name] = (outcome, acts, (weakref.ref(weight), weight._version, weight.data_ptr()))
            elif self._outcomes.pop(name, None) is not None:
                log.warning("%s was quantized and then changed by %s: it is written dense", name, method.name)

    def write_block(self, writer: ShardedWriter, name: str, block: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
        """Every parameter of block ``name`` to ``writer``: packed layers as their format's tensors, the rest dense in
        ``dtypes`` (the checkpoint's stored dtypes)."""
        packed = {}
        for layer_name, module in block.named_modules():
            if layer_name and f"{layer_name}.weight" in dtypes:
                tensors = self.packed_tensors(f"{name}.{layer_name}", module, dtypes[f"{layer_name}.weight"])
                if tensors is not None:
                    packed[f"{layer_name}.weight"] = (layer_name, tensors)
        for n, p in block.named_parameters():
            if n in packed:
                layer_name, tensors = packed[n]
                for suffix, t in tensors.items():
                    writer.add(f"{name}.{layer_name}.{suffix}", t)
            else:
                writer.add(f"{name}.{n}", p.detach().to(dtypes[n]))

    def packed_tensors(self, name: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """The packed tensors replacing ``name.weight``, or None to write it dense."""
        entry = self._outcomes.pop(name, None)
        if entry is None or self.packer is None:
            return None
        outcome, activations, written = entry
        quant = outcome.quant
        if quant is None:
            log.warning("%s has quantized inputs but no weight codes: it is written dense (activation settings in the record)", name)
            return None
        held = get_weight(module).detach()  # in the forwards' dtype: a bfloat16 block holds the codes' values rounded
        # values written over the layer's own weight (`rtn(overwrite=True)`) cannot be compared with it: only untouched
        # since, they are known to be there
        if not untouched(module.weight, written) and (quant.weight.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
                                                      or not holds(held, quant.weight)):
            log.warning("%s was changed after it was quantized: it is written dense (fake-quantized)", name)
            return None
        reason = self.packer.reason_not_packable(quant, is_conv1d(module), activations)
        if reason is not None:
            log.warning("%s is written dense: %s", name, reason)
            return None
        self.packed[name] = PackedLayer(quant.scheme, activations, quant.g_idx is not None, not has_trivial_g_idx(quant))
        return self.packer.tensors(quant, dtype, outcome.input_scale, activations)


def untouched(weight: torch.Tensor, written: tuple) -> bool:
    """``weight`` is the tensor the quantizing stage wrote its values into (`LayerOutcomes.keep`), with no write since:
    torch counts every in-place write to a tensor (its version), and a parameter replaced is another tensor or other
    memory. Then it holds the codes' values without comparing them (`holds` reads the whole layer twice). Writes
    through ``.data`` are not counted by torch; nothing in the engine or its methods writes a weight so."""
    return written[0]() is weight and (weight._version, weight.data_ptr()) == written[1:]


# elements of a layer compared at a time by `holds`: a slice's converted copy (512 KB in bfloat16) comes from the heap
# and is reused, where a whole 8B MLP layer's would be a fresh 117 MB mapping
COMPARE_ELEMENTS = 1 << 18


def holds(held: torch.Tensor, weight: torch.Tensor) -> bool:
    """``held`` equals ``weight`` converted to ``held``'s dtype and device (`torch.equal` of the two), compared a slice
    of rows at a time."""
    if held.shape != weight.shape:
        return False
    if held.dtype == weight.dtype and held.device == weight.device or held.dim() == 0:
        return torch.equal(held, weight.to(held.device, held.dtype))
    rows = max(1, COMPARE_ELEMENTS // max(held[0].numel(), 1))
    return all(torch.equal(held[r : r + rows], weight[r : r + rows].to(held.device, held.dtype))
               for r in range(0, held.shape[0], rows))
