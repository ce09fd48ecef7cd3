"""Build Intel's auto-round 0.16.1 in its own virtual environment, the anchor bench/autoround_quality.py runs.

    python bench/anchors/autoround_venv.py [--venv ~/.cache/llm-compress/autoround-0.16.1] [--rebuild]

Installs torch 2.13.0 first (the CPU build: this machine's pip finds it before any CUDA wheel) and then
``auto-round==0.16.1`` and compressed-tensors 0.20.1 (the optional dependency of auto-round's ``llm_compressor``
format, the one our evaluator reads) with torch pinned, so their requirements resolve against that torch and pull
no CUDA build. Ends by importing auto_round and compressed_tensors in the venv and printing the versions.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchor_venv  # noqa: E402

AUTOROUND_VERSION = "0.16.1"
TORCH_VERSION = "2.13.0"
COMPRESSED_TENSORS_VERSION = "0.20.1"
DEFAULT_VENV = Path.home() / ".cache" / "llm-compress" / f"autoround-{AUTOROUND_VERSION}"


def check(venv: Path) -> str:
    """``auto-round X, compressed-tensors Y, torch Z`` from the venv's own interpreter."""
    code = ("import auto_round, compressed_tensors, torch; print(f'auto-round {auto_round.__version__}, "
            "compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}')")
    return anchor_venv.check(venv, code, "auto_round or compressed_tensors")


def build_venv(venv: Path = DEFAULT_VENV, rebuild: bool = False) -> str:
    """Create ``venv`` with auto-round and CPU torch unless it already imports auto_round; what `check` says."""
    steps = [["install", f"torch=={TORCH_VERSION}"],
             ["install", f"auto-round=={AUTOROUND_VERSION}", f"compressed-tensors=={COMPRESSED_TENSORS_VERSION}", f"torch=={TORCH_VERSION}"]]
    return anchor_venv.build(venv, rebuild, steps, check)


def main() -> None:
    args = anchor_venv.arguments(__doc__, DEFAULT_VENV)
    print(f"{build_venv(args.venv, args.rebuild)} in {args.venv}")


if __name__ == "__main__":
    main()
