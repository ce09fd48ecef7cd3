"""`holds`: the packer's check that a block still holds a layer's quantized values, in row slices."""

from __future__ import annotations

import pytest
import torch

from compress.engine import outcomes
from compress.engine.outcomes import holds


@pytest.fixture(autouse=True)
def small_slices(monkeypatch):
    monkeypatch.setattr(outcomes, "COMPARE_ELEMENTS", 3 * 64)  # slices of 3 rows: the last slice is partial


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_holds_is_torch_equal_of_the_converted_weight(dtype):
    torch.manual_seed(0)
    weight = torch.randn(10, 64)
    held = weight.to(dtype)
    assert torch.equal(held, weight.to(dtype)) and holds(held, weight)
    for row in (0, 4, 9):  # a change in the first, a middle and the last (partial) slice
        changed = held.clone()
        changed[row, 5] = changed[row, 5] + 1
        assert not holds(changed, weight)
    assert holds(held.t(), weight.t())  # a transposed view (GPT-2's Conv1D weight), sliced by its rows
    assert not holds(held[:9], weight)  # another shape


class _Stage:
    """What `LayerOutcomes.keep` asks of a method: its outcomes and its record."""

    name = "rtn"

    def __init__(self, kept):
        self.kept = kept

    def take_outcomes(self):
        return self.kept

    def record(self):
        return {}


@pytest.mark.parametrize("change", ["none", "other values", "the same values", "replaced"])
def test_a_layer_is_packed_unless_its_weight_changed_after_it_was_quantized(change, caplog):
    """The packer's check, end to end in `LayerOutcomes`: a weight written by nothing after its stage is packed without
    comparing it; an in-place write (the values changed or not) or another tensor is compared with the codes' values."""
    from compress.checkpoints.model_io import set_weight
    from compress.engine.methods.base import LayerOutcome
    from compress.formats.compressed_tensors import CompressedTensorsFormat
    from compress.quantizers.grid import QuantScheme
    from compress.quantizers.rtn import rtn

    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 8, bias=False).to(torch.bfloat16)
    quant = rtn(layer.weight.detach(), QuantScheme(4, True, 32))
    set_weight(layer, quant.weight)
    kept = outcomes.LayerOutcomes(CompressedTensorsFormat())
    kept.keep(_Stage({"l": LayerOutcome(quant.weight, {}, quant=quant)}), {"l": layer})
    assert outcomes.untouched(layer.weight, kept._outcomes["l"][2])
    compared = []
    real_holds = outcomes.holds
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(outcomes, "holds", lambda held, weight: compared.append(1) or real_holds(held, weight))
        if change == "other values":
            set_weight(layer, quant.weight.float() * 2)
        elif change == "the same values":
            set_weight(layer, quant.weight)
        elif change == "replaced":
            layer.weight = torch.nn.Parameter(quant.weight.to(torch.bfloat16).clone())
        tensors = kept.packed_tensors("l", layer, torch.bfloat16)
    assert (tensors is None) == (change == "other values")
    assert bool(compared) == (change != "none")  # compared only where written since


def test_values_written_over_the_weight_are_packed_only_while_untouched():
    """`rtn(overwrite=True)` leaves the codes' values in the layer's own weight: comparing the two would always agree,
    so a write after the stage (here the same values again) writes the layer dense, and no write packs it."""
    from compress.checkpoints.model_io import set_weight
    from compress.engine.methods.base import LayerOutcome
    from compress.formats.compressed_tensors import CompressedTensorsFormat
    from compress.quantizers.grid import QuantScheme
    from compress.quantizers.rtn import rtn

    for written_since in (False, True):
        torch.manual_seed(2)
        layer = torch.nn.Linear(64, 8, bias=False).to(torch.bfloat16)
        quant = rtn(layer.weight.detach(), QuantScheme(4, True, 32), overwrite=True)
        assert quant.weight.data_ptr() == layer.weight.data_ptr()
        set_weight(layer, quant.weight)  # its own memory: nothing to copy, nothing counted
        kept = outcomes.LayerOutcomes(CompressedTensorsFormat())
        kept.keep(_Stage({"l": LayerOutcome(quant.weight, {}, quant=quant)}), {"l": layer})
        if written_since:
            with torch.no_grad():
                layer.weight.mul_(1.0)
        assert (kept.packed_tensors("l", layer, torch.bfloat16) is None) == written_since
