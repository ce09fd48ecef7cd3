"""The process's allocator policy: which one each command gets, and that a policy does what it says to glibc."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from compress.cli import allocator, app

# Run in a fresh interpreter: apply a policy, allocate 2 MB, and say whether it came from the heap (brk) or from a
# mapping of its own; /proc/self/maps names the heap's range "[heap]".
PROBE = """
import sys
import numpy as np
from compress.cli.allocator import FRUGAL, STREAMING, set_allocator
set_allocator({"frugal": FRUGAL, "streaming": STREAMING}[sys.argv[1]])
block = np.empty(2 << 20, dtype=np.uint8)
address = block.__array_interface__["data"][0]
heap = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
print(any(int(lo, 16) <= address < int(hi, 16) for lo, hi in heap))
"""


def from_heap(policy: str) -> bool:
    out = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_policies_decide_where_a_2mb_buffer_comes_from():
    assert not from_heap("frugal")  # 1 MB threshold: its own mapping, returned to the OS when freed
    assert from_heap("streaming")  # 4 MB threshold: the heap, reused by the next chunk's temporaries


@pytest.mark.parametrize("command, policy", [("export", "STREAMING"), ("measure", "STREAMING"), ("quantize", "FRUGAL"), ("inspect", "FRUGAL")])
def test_each_command_runs_under_its_policy(monkeypatch, command, policy):
    applied = []
    monkeypatch.setattr(allocator, "set_allocator", applied.append)
    result = CliRunner().invoke(app, [command, "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert applied == [getattr(allocator, policy)]


@pytest.mark.parametrize("export, policy", [("", "FRUGAL"), ("export: {path: OUT.gguf, type: q6_k}\n", "STREAMING")], ids=["no-export", "export"])
def test_a_recipe_that_exports_gguf_runs_under_the_export_policy(monkeypatch, tmp_path, export, policy):
    from compress.cli import compressing
    from conftest import REFERENCE_MODEL

    applied, executed = [], []
    monkeypatch.setattr(allocator, "set_allocator", applied.append)
    monkeypatch.setattr(compressing, "_execute", lambda recipe, as_json: executed.append(recipe))
    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "out"
    recipe.write_text(f"model: {REFERENCE_MODEL}\nstages: [{{method: rtn}}]\noutput: {{path: {out}, format: fake}}\n"
                      + export.replace("OUT", str(out)))
    result = CliRunner().invoke(app, ["run", str(recipe)], catch_exceptions=False)
    assert result.exit_code == 0 and len(executed) == 1
    assert applied[-1] == getattr(allocator, policy)
