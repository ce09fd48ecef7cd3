"""An anchor tool's own virtual environment (its pins clash with ours): built once, checked by importing the tool
with the venv's own interpreter. `bench/anchors/vllm_venv.py` and `bench/anchors/autoround_venv.py` use it."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable


def check(venv: Path, code: str, modules: str) -> str:
    """The last line ``code`` prints in the venv's interpreter; raises with its last error line when it fails."""
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise SystemExit(f"{modules} does not import in {venv}: {lines[-1] if lines else proc.returncode}")
    return proc.stdout.strip().splitlines()[-1]


def build(venv: Path, rebuild: bool, steps: list[list[str]], checked: Callable[[Path], str]) -> str:
    """Create ``venv`` and run each pip ``steps`` entry in it (``["install", ...]``, ``["uninstall", "-y", ...]``)
    unless it already passes ``checked``; what ``checked`` says."""
    python = venv / "bin" / "python"
    if python.exists() and not rebuild:
        try:
            return checked(venv)
        except SystemExit:
            pass  # a half-built venv: build it again
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for step in steps:
        subprocess.run([str(python), "-m", "pip", step[0], "-q", *step[1:]], check=True)
    return checked(venv)


def arguments(doc: str, default: Path) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=default)
    ap.add_argument("--rebuild", action="store_true", help="Delete and build the venv again.")
    return ap.parse_args()
