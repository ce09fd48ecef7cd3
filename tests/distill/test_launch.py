"""Two DDP processes (gloo, CPU) under `accelerate launch` give one process's loss curve and weights."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

import pytest
import torch
from conftest import CALIB_TEXT
from safetensors.torch import load_file

from compress.distill.config import DistillSpec, StudentSpec
from compress.run.distill import LOG_FILE, run_distill
from compress.run.recipe import OutputSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate CLI not installed")
def test_two_processes_match_one_with_the_same_global_batch(tiny_llama, tmp_path):
    steps, seq_len = 4, 32
    one = run_distill(
        tiny_llama,
        DistillSpec(data=CALIB_TEXT, student=StudentSpec(every=2), steps=steps, batch_size=4, seq_len=seq_len, lr=3e-3, warmup_steps=1),
        OutputSpec(path=tmp_path / "one"),
    )
    # accelerate 1.x starts several CPU processes only through its torchrun path (--multi_gpu); our
    # --device cpu then makes each one a CPU rank on the gloo backend.
    cmd = [
        "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(_free_port()), "-m", "compress.cli",
        "distill", str(tiny_llama), "-o", str(tmp_path / "two"), "--student", "every:2", "--data", str(CALIB_TEXT),
        "--steps", str(steps), "--batch-size", "2", "--seq-len", str(seq_len), "--lr", "3e-3", "--warmup-steps", "1",
        "--device", "cpu", "--json",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["processes"] == 2
    log = json.loads((tmp_path / "two" / LOG_FILE).read_text())
    assert log["processes"] == 2 and len(log["history"]) == steps
    curve_two = [h["loss"] for h in log["history"]]
    curve_one = [h.loss for h in one.history]
    assert curve_two == pytest.approx(curve_one, abs=1e-4)
    assert curve_one[-1] < curve_one[0]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
