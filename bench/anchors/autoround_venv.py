"""Build Intel's auto-round 0.16.1 in its own virtual environment, the anchor bench/autoround_quality.py runs.

    python bench/anchors/autoround_venv.py [--venv ~/.cache/llm-compress/autoround-0.16.1] [--rebuild]

Installs torch 2.13.0 first (the CPU build: this machine's pip finds it before any CUDA wheel) and then
``auto-round==0.16.1`` and compressed-tensors 0.20.1 (the optional dependency of auto-round's ``llm_compressor``
format, the one our evaluator reads) with torch pinned, so their requirements resolve against that torch and pull
no CUDA build. Ends by importing auto_round and compressed_tensors in the venv and printing the versions.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

AUTOROUND_VERSION = "0.16.1"
TORCH_VERSION = "2.13.0"
COMPRESSED_TENSORS_VERSION = "0.20.1"
DEFAULT_VENV = Path.home() / ".cache" / "llm-compress" / f"autoround-{AUTOROUND_VERSION}"


def check(venv: Path) -> str:
    """``auto-round X, torch Y`` from the venv's own interpreter; raises with its last line when the import fails."""
    code = ("import auto_round, compressed_tensors, torch; print(f'auto-round {auto_round.__version__}, "
            "compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}')")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise SystemExit(f"auto_round or compressed_tensors does not import in {venv}: {lines[-1] if lines else proc.returncode}")
    return proc.stdout.strip().splitlines()[-1]


def build_venv(venv: Path = DEFAULT_VENV, rebuild: bool = False) -> str:
    """Create ``venv`` with auto-round and CPU torch unless it already imports auto_round; what `check` says."""
    python = venv / "bin" / "python"
    if python.exists() and not rebuild:
        try:
            return check(venv)
        except SystemExit:
            pass  # a half-built venv: build it again
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, f"auto-round=={AUTOROUND_VERSION}", f"compressed-tensors=={COMPRESSED_TENSORS_VERSION}",
                    f"torch=={TORCH_VERSION}"], check=True)
    return check(venv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--rebuild", action="store_true", help="Delete and build the venv again.")
    args = ap.parse_args()
    print(f"{build_venv(args.venv, args.rebuild)} in {args.venv}")


if __name__ == "__main__":
    main()
