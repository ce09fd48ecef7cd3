"""Compiled inner loops, built on first use with the machine's C compiler: GPTQ's column loops (``csrc/columns.c``)
and, through `compiled`, other sources (the clipping search, ``csrc/clipping.c``; the GGUF encoders' scale search,
``formats/gguf/csrc``).

GPTQ's column loop runs ~10 small tensor operations per column; through torch each costs about a microsecond of
dispatch, more than its arithmetic on a layer of a few thousand rows, and the loop holds the interpreter's lock, so
a second thread cannot share it (measured: two threads on halves of the rows ran slower than one). Compiled, a
column is one pass over its rows, and the rows split between threads with the lock released.

The build: ``cc`` (or ``$CC``) compiles the source once into ``$XDG_CACHE_HOME/llm-compress/native`` (default
``~/.cache``), a file named by a hash of the source, the flags and the architecture, written under a temporary name
and renamed (ranks building at once do not see a half-written file); later processes load it (a few ms). The flags
keep the torch loop's numerics: no fused multiply-adds (``-ffp-contract=off``), no fast-math; the instruction set is
chosen when the library is loaded, not when it is built (``target_clones``: AVX2 where the CPU has it, the
architecture's baseline otherwise), so the file runs on any CPU of its architecture. Without a compiler, or where
the build fails, `compiled` returns None and the callers keep their torch or numpy loops: the same bits, only slower
(the clipping search alone takes its powers by polynomials, so it may choose differently at near-ties: see
`compress.quantizers.clipping`). ``COMPRESS_NATIVE=0`` asks for those everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "columns.c"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
CLONES = "-DCOMPRESS_CLONES"  # dropped where the compiler or platform has no target_clones (a retry without it)
_I64, _PTR, _F32, _I32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int32
SIGNATURES = (  # each function's argument types (all return void), set once where the library is loaded
    ("gptq_int_columns", (_I64,) * 6 + (_PTR,) * 5 + (_I64,) + (_PTR,) * 3 + (_F32, _F32, _I32, _PTR, _I32)),
    ("gguf_affine_columns", (_I64,) * 6 + (_PTR,) * 4 + (_I64,) + (_PTR,) * 3 + (_F32, _F32)),
)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-compress" / "native"


def columns_library() -> ctypes.CDLL | None:
    """The loaded column loops, or None (the torch loop): asked off with ``COMPRESS_NATIVE=0``, or no build."""
    return compiled(SOURCE, SIGNATURES)


def compiled(source: Path, signatures: tuple[tuple[str, tuple], ...], extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``source`` built (with the `FLAGS` and ``extra`` ones) and loaded, its functions' argument types set from
    ``signatures`` (``(name, types)`` pairs; each returns void); None where ``COMPRESS_NATIVE=0`` or it cannot be
    built or loaded."""
    if os.environ.get("COMPRESS_NATIVE", "1") == "0":
        return None
    return _load(source, signatures, extra)


@functools.cache
def _load(source: Path, signatures: tuple[tuple[str, tuple], ...], extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    path = _built(source, extra)
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        log.info("compiled %s does not load (%s): using the uncompiled loop", path, error)
        return None
    for name, arguments in signatures:
        getattr(library, name).argtypes = arguments
        getattr(library, name).restype = None
    return library


def _built(source: Path, extra: tuple[str, ...] = ()) -> Path | None:
    """The shared library of ``source`` in the cache, compiled if missing; None where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler (cc): %s's loops run uncompiled", source.name)
        return None
    text = source.read_bytes()
    for flags in ((*FLAGS, *extra, CLONES), (*FLAGS, *extra)):
        key = hashlib.sha256(text + " ".join(flags).encode() + platform.machine().encode()).hexdigest()[:16]
        path = cache_dir() / f"{source.stem}-{key}.so"
        if path.exists():
            return path
        error = _compile(compiler, flags, source, path)
        if error is None:
            return path
        log.info("building %s with %s failed: %s", source.name, " ".join(flags), error)
    log.info("%s could not be built: its loops run uncompiled", source.name)
    return None


def _compile(compiler: str, flags: tuple[str, ...], source: Path, path: Path) -> str | None:
    """Compile ``source`` into ``path`` through a temporary file in its folder; the error, or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as handle:
            partial = Path(handle.name)
    except OSError as error:
        return f"cannot write to {path.parent}: {error}"
    try:
        done = subprocess.run([compiler, *flags, "-o", str(partial), str(source)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        os.replace(partial, path)
        return None
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    finally:
        partial.unlink(missing_ok=True)
