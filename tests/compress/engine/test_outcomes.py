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
