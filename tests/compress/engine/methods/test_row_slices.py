"""Row slices of a layer solved apart and merged (`Method.row_parallel` / `merge_rows`, what the engine does
with several processes): GPTQ's and N:M SparseGPT's rows are independent given H (the papers' column loop
updates every row alike), so the merged slices are the layer solved whole; grids or masks that couple rows
are not split."""

from __future__ import annotations

import pytest
import torch

from compress.engine.statistics import Stat
from compress.run.recipe import parse_recipe

ROWS, COLS = 96, 128


def build_method(stage: dict):
    (method,) = parse_recipe({"model": "m", "output": {"path": "o"}, "stages": [stage]}).methods()
    return method


def _layer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, COLS, generator=g) @ (torch.eye(COLS) + 0.1 * torch.randn(COLS, COLS, generator=g))
    weight = torch.randn(ROWS, COLS, generator=g) * 0.05
    return weight, {Stat.HESSIAN: 2 / 512 * x.T @ x, Stat.INPUT_ABSMAX: x.abs().amax(0)}


def _merged(method, weight, stats, cuts):
    bounds = [0, *cuts, ROWS]
    return method.merge_rows([method.transform_layer("l", weight[a:b], stats) for a, b in zip(bounds, bounds[1:])])


@pytest.mark.parametrize("settings", [
    {"method": "gptq", "bits": 4, "group_size": 32},
    {"method": "gptq", "bits": 3, "group_size": -1, "act_order": False, "mse": False},
    {"method": "gptq", "bits": 8, "group_size": -1, "activations": "int8-tensor"},
    {"method": "gptq", "scheme": "fp8-dynamic"},
    {"method": "sparsegpt", "pattern": "2:4"},
    {"method": "sparsegpt", "pattern": "2:4", "bits": 4, "group_size": 32},
])
def test_merged_slices_are_the_whole_layer(settings):
    method = build_method(settings)
    assert method.row_parallel
    weight, stats = _layer()
    whole = method.transform_layer("l", weight, stats)
    merged = _merged(method, weight, stats, [40, 41])  # uneven slices, one of a single row
    assert torch.equal(merged.weight, whole.weight)
    assert merged.info.keys() == whole.info.keys()
    for key, value in whole.info.items():  # the proxy figures: float32 products of other shapes (a 1-row slice)
        assert merged.info[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    assert merged.energy == pytest.approx(whole.energy, rel=1e-6)
    if whole.quant is not None:
        for field in ("codes", "scale", "zero"):
            assert torch.equal(getattr(merged.quant, field), getattr(whole.quant, field)), field
    assert (merged.input_scale is None) == (whole.input_scale is None)
    if whole.input_scale is not None:
        assert torch.equal(merged.input_scale, whole.input_scale)


@pytest.mark.parametrize("settings", [
    {"method": "sparsegpt", "sparsity": 0.5},  # the unstructured mask ranks a whole column block, all rows together
    {"method": "gptq", "scheme": "nvfp4a16"},  # one global scale from the whole weight
    {"method": "gptq", "scheme": "fp8-block"},  # a scale per 128 x 128 block of rows and columns
])
def test_methods_coupling_rows_are_not_split(settings):
    assert not build_method(settings).row_parallel
