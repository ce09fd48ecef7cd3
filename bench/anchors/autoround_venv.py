"""Build Intel's auto-round 0.16.1 in its own virtual environment, the anchor bench/autoround_quality.py runs.

    python bench/anchors/autoround_venv.py [--venv ~/.cache/llm-compress/autoround-0.16.1] [--rebuild]

Installs torch 2.13.0 first (the CPU build: this machine's pip finds it before any CUDA wheel) and then
``auto-round==0.16.1``, compressed-tensors 0.20.1 (the optional dependency of auto-round's ``llm_compressor``
format, the one our evaluator reads), and gguf 0.19.0 and sentencepiece 0.2.3 (what the llama.cpp conversion code
bundled in auto-round imports for its GGUF export: ``conversion/base.py`` imports ``gguf``, and a llama model's
``set_vocab`` imports ``sentencepiece`` before it looks for a ``tokenizer.model``) with torch pinned, so their
requirements resolve against that torch and pull no CUDA build. Ends by importing them in the venv and printing the
versions.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchor_venv  # noqa: E402

AUTOROUND_VERSION = "0.16.1"
TORCH_VERSION = "2.13.0"
COMPRESSED_TENSORS_VERSION = "0.20.1"
GGUF_VERSION = "0.19.0"
SENTENCEPIECE_VERSION = "0.2.3"
DEFAULT_VENV = Path.home() / ".cache" / "llm-compress" / f"autoround-{AUTOROUND_VERSION}"


def check(venv: Path) -> str:
    """``auto-round X, compressed-tensors Y, gguf G, torch Z`` from the venv's own interpreter."""
    code = ("import auto_round, compressed_tensors, gguf, sentencepiece, torch; from importlib.metadata import version; "
            "print(f'auto-round {auto_round.__version__}, compressed-tensors {compressed_tensors.__version__}, "
            "gguf {version(\"gguf\")}, torch {torch.__version__}')")
    return anchor_venv.check(venv, code, "auto_round, compressed_tensors, gguf or sentencepiece")


def build_venv(venv: Path = DEFAULT_VENV, rebuild: bool = False) -> str:
    """Create ``venv`` with auto-round and CPU torch unless it already imports auto_round; what `check` says."""
    steps = [["install", f"torch=={TORCH_VERSION}"],
             ["install", f"auto-round=={AUTOROUND_VERSION}", f"compressed-tensors=={COMPRESSED_TENSORS_VERSION}",
              f"gguf=={GGUF_VERSION}", f"sentencepiece=={SENTENCEPIECE_VERSION}", f"torch=={TORCH_VERSION}"]]
    return anchor_venv.build(venv, rebuild, steps, check)


def main() -> None:
    args = anchor_venv.arguments(__doc__, DEFAULT_VENV)
    print(f"{build_venv(args.venv, args.rebuild)} in {args.venv}")


if __name__ == "__main__":
    main()
