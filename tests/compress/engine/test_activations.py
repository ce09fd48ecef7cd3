"""Block inputs beyond the memory budget wait on disk and come back bit for bit; a run under a budget writes
what a run without one writes."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from compress.cli.app import app
from compress.engine.activations import Activations
from conftest import CALIB_TEXT, REFERENCE_MODEL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batches_beyond_the_budget_go_to_disk_and_come_back_exact(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 5, 8, generator=gen).to(dtype), (i,), {"mask": torch.ones(5)}) for i in range(5)]
    one = batches[0][0].numel() * batches[0][0].element_size()
    store = Activations(budget=2 * one, directory=tmp_path)
    for hidden, args, kwargs in batches:
        store.append(hidden, args, kwargs)
    assert store.spilled_bytes == 3 * one  # the first two fit the budget
    assert os.listdir(tmp_path) == []  # the disk copy has no name: nothing stays behind, whatever ends the run
    assert len(store) == 5
    for (hidden, args, kwargs), (back, args_back, kwargs_back) in zip(batches, store):
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), hidden.view(torch.uint8))
        assert args_back == args and torch.equal(kwargs_back["mask"], kwargs["mask"])
    assert torch.equal(store[3][0], batches[3][0])  # random access too
    store.close()


def test_without_a_budget_everything_stays_in_memory(tmp_path):
    store = Activations(directory=tmp_path)
    hidden = torch.randn(64, 64)
    store.append(hidden, (), {})
    assert store.spilled_bytes == 0 and store[0][0] is hidden


def test_a_run_under_a_budget_writes_the_same_bytes(tmp_path):
    """3 batches of 2 x 64 tokens x 256 wide (131 kB each): all in memory, the first in memory and two on disk
    (200kB), all on disk (0)."""
    import yaml

    outputs = {}
    for budget in (None, "200kB", "0"):
        out = tmp_path / f"out-{budget}"
        calibration = {"path": str(CALIB_TEXT), "samples": 6, "seq_len": 64, "batch_size": 2}
        if budget is not None:
            calibration["activation_memory"] = budget
        recipe = {"model": str(REFERENCE_MODEL), "calibration": calibration, "stages": [{"method": "gptq"}], "output": {"path": str(out)}}
        (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        done = CliRunner().invoke(app, ["run", str(tmp_path / "recipe.yaml"), "--json"])
        assert done.exit_code == 0, done.output
        outputs[budget] = load_file(out / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out-0", "out-200kB", "out-None", "recipe.yaml"]  # nothing else left
    for budget in ("200kB", "0"):
        assert outputs[budget].keys() == outputs[None].keys()
        assert all(torch.equal(outputs[budget][k], outputs[None][k]) for k in outputs[None])


def test_a_size_that_is_not_one_is_a_one_line_error(tmp_path):
    done = CliRunner().invoke(app, ["quantize", str(REFERENCE_MODEL), "-o", str(tmp_path / "out"), "--method", "gptq",
                                    "--calib", str(CALIB_TEXT), "--activation-memory", "lots"])
    assert done.exit_code == 2 and "size 'lots' is not understood" in done.output and len(done.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
