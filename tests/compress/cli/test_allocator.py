"""The process's allocator policy: which one each command gets, and that a policy does what it says to glibc."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from compress.cli import allocator, app

# Run in a fresh interpreter: apply a policy, allocate some MB, and say whether they came from the heap (brk) or from a
# mapping of their own; /proc/self/maps names the heap's range "[heap]".
PROBE = """
import sys
import numpy as np
from compress.cli.allocator import CALIBRATING, FRUGAL, STREAMING, set_allocator
set_allocator({"frugal": FRUGAL, "streaming": STREAMING, "calibrating": CALIBRATING}[sys.argv[1]])
block = np.empty(int(sys.argv[2]) << 20, dtype=np.uint8)
address = block.__array_interface__["data"][0]
heap = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
print(any(int(lo, 16) <= address < int(hi, 16) for lo, hi in heap))
"""


def from_heap(policy: str, megabytes: int = 2) -> bool:
    out = subprocess.run([sys.executable, "-c", PROBE, policy, str(megabytes)], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_policies_decide_where_a_2mb_buffer_comes_from():
    assert not from_heap("frugal")  # 1 MB threshold: its own mapping, returned to the OS when freed
    assert from_heap("streaming")  # 4 MB threshold: the heap, reused by the next chunk's temporaries
    assert not from_heap("streaming", 12)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_calibrating_policy_keeps_a_chunks_temporaries_on_the_heap():
    from compress.engine.one_pass import CHUNK_BYTES

    assert from_heap("calibrating", CHUNK_BYTES >> 20)  # the widest temporary of a chunk of windows
    assert from_heap("calibrating", 4 * CHUNK_BYTES >> 20)  # chunks paused at a group: their temporaries too
    assert not from_heap("calibrating", 128)  # a wide layer's Hessian: its own mapping, returned when freed


KEPT = """
import sys
import numpy as np
from compress.cli.allocator import CALIBRATING, FRUGAL, set_allocator
set_allocator({"frugal": FRUGAL, "calibrating": CALIBRATING}[sys.argv[1]])
blocks = [np.ones(40 << 20, dtype=np.uint8) for _ in range(4)]  # 160 MB of a block's temporaries, written
del blocks  # the block ends: all freed at once
heap = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
print(sum(int(hi, 16) - int(lo, 16) for lo, hi in heap) >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_calibrating_heap_keeps_a_blocks_freed_temporaries_for_the_next_block():
    def heap_mb(policy: str) -> int:
        return int(subprocess.run([sys.executable, "-c", KEPT, policy], capture_output=True, text=True, check=True).stdout)

    assert heap_mb("calibrating") >= 150  # not trimmed: the next block's temporaries take these pages again
    assert heap_mb("frugal") < 20  # 40 MB buffers are mappings of their own there, unmapped when freed


REUSED = """
import sys
import torch
from compress.cli.allocator import CALIBRATING, FRUGAL, set_allocator
from compress.quantizers import pages
set_allocator({"frugal": FRUGAL, "calibrating": CALIBRATING}[sys.argv[1]])
first = pages.empty((40 << 20,), torch.uint8)
address = first.data_ptr()
del first  # no tensor uses the buffer any more
kept = pages.REUSE.held
print(kept, pages.empty((40 << 20,), torch.uint8).data_ptr() == address, pages.REUSE.limit)
"""


def test_only_the_data_free_policy_reuses_large_buffers():
    """Under FRUGAL a freed 40 MB buffer is the next one of its size (no fresh pages to zero); under CALIBRATING none is
    kept (its heap keeps freed memory for every size)."""
    def reused(policy: str) -> str:
        return subprocess.run([sys.executable, "-c", REUSED, policy], capture_output=True, text=True, check=True).stdout.split()

    assert reused("frugal") == [str(40 << 20), "True", str(allocator.FRUGAL.reused_bytes)]
    assert allocator.FRUGAL.reused_bytes >= 40 << 20
    assert reused("calibrating")[::2] == ["0", "0"]  # (the heap may still hand the same address back)


@pytest.mark.parametrize("command, policy", [("export", "STREAMING"), ("measure", "STREAMING"), ("quantize", "FRUGAL"), ("inspect", "FRUGAL")])
def test_each_command_runs_under_its_policy(monkeypatch, command, policy):
    applied = []
    monkeypatch.setattr(allocator, "set_allocator", applied.append)
    result = CliRunner().invoke(app, [command, "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert applied == [getattr(allocator, policy)]


CALIBRATION = "calibration: {path: CALIB, samples: 2, seq_len: 16}\n"
EXPORT = "export: {path: OUT.gguf, type: q6_k}\n"


@pytest.mark.parametrize("method, extra, policy", [
    ("rtn", "", "FRUGAL"),
    ("rtn", EXPORT, "STREAMING"),
    ("rtn", CALIBRATION, "FRUGAL"),
    ("gptq", CALIBRATION, "CALIBRATING"),
    ("gptq", CALIBRATION + EXPORT, "STREAMING"),
    ("awq", CALIBRATION, "CALIBRATING"),
    ("smoothquant", CALIBRATION, "CALIBRATING"),
], ids=["rtn", "export", "rtn-with-calibration", "gptq", "gptq-and-export", "awq", "smoothquant"])
def test_a_recipe_runs_under_the_policy_of_its_hot_loop(monkeypatch, tmp_path, method, extra, policy):
    """Methods that collect statistics run under CALIBRATING (GPTQ's one pass, AWQ's and SmoothQuant's batches);
    RTN (no statistics, even given calibration data) keeps FRUGAL; an export, STREAMING."""
    from conftest import CALIB_TEXT, REFERENCE_MODEL

    class Ran(Exception):
        """The run began (under the policy applied last)."""

    def run_recipe(recipe, *args, window_chunks=False, **kwargs):
        assert window_chunks == (policy == "CALIBRATING")  # chunks of windows only where the heap serves them
        raise Ran

    applied = []
    monkeypatch.setattr(allocator, "set_allocator", applied.append)
    monkeypatch.setattr("compress.run.runner.run_recipe", run_recipe)
    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "out"
    recipe.write_text(f"model: {REFERENCE_MODEL}\nstages: [{{method: {method}}}]\noutput: {{path: {out}, format: fake}}\n"
                      + extra.replace("OUT", str(out)).replace("CALIB", str(CALIB_TEXT)))
    with pytest.raises(Ran):
        CliRunner().invoke(app, ["run", str(recipe)], catch_exceptions=False)
    assert applied[-1] == getattr(allocator, policy)


@pytest.mark.parametrize("method, extra, policy", [
    ("rtn", [], "STREAMING"),
    ("gptq", ["--calib", "CALIB"], "CALIBRATED_EXPORT"),
    ("imatrix", ["--calib", "CALIB"], "CALIBRATED_EXPORT"),
])
def test_an_export_with_calibration_text_switches_to_the_calibrated_policy(monkeypatch, tmp_path, method, extra, policy):
    """`compress export` starts under STREAMING; with calibration text (GPTQ's one pass, imatrix's forwards) it switches
    to CALIBRATED_EXPORT before calibrating, and GPTQ's engine runs its windows in chunks."""
    from conftest import CALIB_TEXT, REFERENCE_MODEL

    class Ran(Exception):
        """The export began (under the policy applied last)."""

    applied, chunks = [], []

    def began(*args, window_chunks=False, **kwargs):
        chunks.append(window_chunks)
        raise Ran

    monkeypatch.setattr(allocator, "set_allocator", applied.append)
    monkeypatch.setattr("compress.export.calibrated.export_calibrated", began)
    monkeypatch.setattr("compress.export.imatrix.run_imatrix", began)
    monkeypatch.setattr("compress.export.gguf.export_gguf", began)
    args = ["export", str(REFERENCE_MODEL), "-o", str(tmp_path / "out.gguf"), "--type", "q4_k", "--method", method]
    with pytest.raises(Ran):
        CliRunner().invoke(app, args + [str(CALIB_TEXT) if a == "CALIB" else a for a in extra], catch_exceptions=False)
    assert applied[-1] == getattr(allocator, policy)
    assert chunks == [method == "gptq"]


@pytest.mark.parametrize("given", [None, "5"])
def test_the_cli_shortens_openmps_spin_before_torch_loads_unless_the_user_set_it(given):
    """`compress.cli` sets GOMP_SPINCOUNT before torch (and with it libgomp, which reads it as it loads) is imported;
    a value in the environment is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | ({"GOMP_SPINCOUNT": given} if given else {})
    code = "import compress.cli, os, sys; print('torch' in sys.modules, os.environ['GOMP_SPINCOUNT'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd="/").stdout.split()
    assert out == ["False", given or "1000"]  # torch, imported by the command that runs, loads after it
