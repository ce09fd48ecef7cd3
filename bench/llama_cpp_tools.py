"""llama.cpp's command-line tools (llama-quantize, llama-imatrix, llama-perplexity), built from the
llama.cpp sources vendored in llama-cpp-python's source distribution, so they match the installed bindings.

    python bench/llama_cpp_tools.py [--sdist PATH] [TOOL ...]     # build (first time) and print the paths

The bindings ship only the library; the benches need the tools to compare our imatrix and quantized files
with what llama.cpp itself writes. The build (CPU only, Release, just the wanted targets, -j2) goes to
``~/.cache/llm-compress/llama.cpp-<version>-portable`` or to ``$LLAMA_CPP_TOOLS``; later calls reuse it. The sdist
comes from ``--sdist``/``$LLAMA_CPP_SDIST``, else ``pip download llama-cpp-python==<installed> --no-binary``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

TOOLS = ("llama-quantize", "llama-imatrix", "llama-perplexity")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: no clash with the bindings' libllama.so
    # portable, like the bindings' build (README): a native build can pick up CPU features the machine
    # advertises but the process may not use (AMX in some VMs), and die with SIGILL
    *[f"-D{flag}" for flag in ("GGML_NATIVE=OFF", "GGML_AVX2=ON", "GGML_AVX512=OFF", "GGML_AMX_TILE=OFF", "GGML_AMX_INT8=OFF", "GGML_AMX_BF16=OFF")],
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
]


def llama_cpp_version() -> str:
    """The installed llama-cpp-python version: the tools must be built from the same llama.cpp."""
    return version("llama_cpp_python")


def cache_dir() -> Path:
    """Where the sources and the build live (``$LLAMA_CPP_TOOLS`` overrides the default)."""
    override = os.environ.get("LLAMA_CPP_TOOLS")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "llm-compress" / f"llama.cpp-{llama_cpp_version()}-portable"


def binary_path(name: str, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "build" / "bin" / name


def fetch_sdist(dest: Path) -> Path:
    """The llama-cpp-python sdist of the installed version: ``$LLAMA_CPP_SDIST`` if set, else pip download."""
    given = os.environ.get("LLAMA_CPP_SDIST")
    if given:
        return Path(given)
    pinned = f"llama-cpp-python=={llama_cpp_version()}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", pinned, "--no-deps", "--no-binary", ":all:", "-d", str(dest)],
        check=True,
    )
    return next(dest.glob("llama_cpp_python-*.tar.gz"))


def extract_llama_cpp(sdist: Path, src: Path) -> None:
    """Unpack only ``vendor/llama.cpp`` of the sdist into ``src``."""
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 3)
            if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"]:
                m.name = parts[3]
                members.append(m)
        tar.extractall(src, members=members, filter="data")


def build(names: tuple[str, ...] = TOOLS, sdist: Path | None = None, jobs: int = 2) -> float:
    """Configure and build the given tool targets; returns the wall time in seconds."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():  # sources unpacked by an earlier build are reused
        with tempfile.TemporaryDirectory() as tmp:
            extract_llama_cpp(sdist or fetch_sdist(Path(tmp)), src)
    build_dir = root / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *names], check=True)
    return time.perf_counter() - start


def tool(name: str) -> Path:
    """Path of a llama.cpp tool, building it the first time it is asked for."""
    if name not in TOOLS:
        raise ValueError(f"unknown llama.cpp tool {name!r}; known: {', '.join(TOOLS)}")
    path = binary_path(name)
    if not path.exists():
        build((name,))
    return path


def _run(command: list[str], log: Path | None) -> None:
    """Run a tool; its (long) log goes to ``log``, or is shown only when the tool fails."""
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        log.write_text(done.stdout)
    if done.returncode != 0:  # a child process already: a crash (negative code: its signal) ends only the tool
        from compress.eval.llama_cpp_worker import describe_exit

        raise RuntimeError(f"{' '.join(command)} failed ({describe_exit(done.returncode)[0]}):\n{done.stdout[-4000:]}")


def llama_quantize(src: Path, dst: Path, ftype: int, imatrix: Path | None = None, threads: int = 2,
                   log: Path | None = None, pure: bool = True) -> None:
    """``llama-quantize [--pure] [--imatrix F] SRC DST FTYPE``. ``pure``: every matrix, token_embd and output
    included, in the file type's base type (``ftype``: llama.cpp's ``LLAMA_FTYPE_*`` number, e.g. 14 for
    Q4_K_S); otherwise llama.cpp's own mix for that file type (e.g. Q4_K_M's Q6_K layers)."""
    extra = (["--pure"] if pure else []) + (["--imatrix", str(imatrix)] if imatrix is not None else [])
    _run([str(tool("llama-quantize")), *extra, str(src), str(dst), str(ftype), str(threads)], log)


def llama_imatrix(model: Path, text: Path, out: Path, ctx: int = 512, chunks: int = -1, threads: int = 2,
                  log: Path | None = None) -> None:
    """``llama-imatrix`` over the first ``chunks`` windows of ``ctx`` tokens of ``text`` (one window per
    batch, no perplexity). It has no BOS switch: it puts BOS first in each window only when the model's
    ``tokenizer.ggml.add_bos_token`` says so."""
    _run([str(tool("llama-imatrix")), "-m", str(model), "-f", str(text), "-o", str(out), "-c", str(ctx),
          "-b", str(ctx), "-ub", str(ctx), "--chunks", str(chunks), "--no-ppl", "-t", str(threads)], log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tools", nargs="*", help=f"any of {', '.join(TOOLS)} (default: all)")
    ap.add_argument("--sdist", type=Path, help="llama-cpp-python sdist (default: pip download)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args()
    args.tools = args.tools or list(TOOLS)
    unknown = set(args.tools) - set(TOOLS)
    if unknown:
        ap.error(f"unknown tools: {', '.join(sorted(unknown))}")
    missing = tuple(n for n in args.tools if not binary_path(n).exists())
    if missing:
        seconds = build(missing, args.sdist, args.jobs)
        print(f"built {', '.join(missing)} in {seconds / 60:.1f} min into {cache_dir()}")
    for name in args.tools:
        print(f"{name}: {binary_path(name)}")


if __name__ == "__main__":
    main()
