"""llama.cpp (llama-cpp-python) in a child process, so that a crash inside it cannot take ours down.

llama.cpp is native code built on the user's machine. A build that uses instructions the CPU advertises
but the process may not execute (AMX tiles without the kernel's permission, in some VMs) dies with
SIGILL in the middle of a decode; an out-of-memory kill or a segfault on a malformed file is just as
final. Run in our own process, any of these ends the whole `compress report` (or pytest) run with no
message. Here every call goes to a spawned child (`multiprocessing`, *spawn*: no forked torch state);
when the child dies, the caller gets one `LlamaCppCrash` line naming the file, what was being done, the
signal and the fix, and can fall back to another evaluator.

`LlamaCppWorker.call(fn, *args)` runs a module-level function ``fn(state, *args)`` in the child
(``state``: a dict kept between calls, holding e.g. the loaded model). `LlamaCppModel` is the evaluation
adapter built on it; `quantize` runs ``llama_model_quantize``; `check_build` evaluates a quantized GGUF
and reports the CPU features the build uses.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from compress.errors import CompressError

PORTABLE_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)
_HINTS = {
    signal.SIGILL: "the llama-cpp-python build uses CPU instructions this machine cannot run: reinstall it with "
    f'CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --force-reinstall --no-cache-dir llama-cpp-python',
    signal.SIGKILL: "killed, most often for lack of memory: free memory or evaluate a smaller file",
    # seen here from a GGML_NATIVE build on a CPU that reports AMX: the AMX kernels fault on quantized files
    signal.SIGSEGV: "llama.cpp crashed: a build for CPU features this process may not use (AMX), a malformed file "
    "or a broken build; reinstall llama-cpp-python with the portable CMAKE_ARGS of the README",
    signal.SIGBUS: "llama.cpp crashed reading the file: it may be truncated or on a failing disk",
}


class LlamaCppCrash(CompressError):
    """The llama.cpp child process died (a signal or an exit) instead of answering."""

    def __init__(self, message: str, signal_name: str | None):
        super().__init__(message)
        self.signal_name = signal_name


def available() -> bool:
    """llama-cpp-python is installed (importing it loads no native code we run here)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def _serve(conn) -> None:
    """The child: run each ``(fn, args)`` received, answer ``("ok", result)`` or ``("error", line)``."""
    state: dict[str, Any] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, args = message
        try:
            conn.send(("ok", fn(state, *args)))
        except Exception as exc:  # noqa: BLE001 — reported to the parent as one line
            text = str(exc).strip().splitlines()
            conn.send(("error", f"{type(exc).__name__}: {text[0] if text else ''}"))


def describe_exit(code: int | None) -> tuple[str, str | None]:
    """``(what happened, signal name)`` for a child's exit code (negative: killed by that signal)."""
    if code is not None and code < 0:
        sig = signal.Signals(-code)
        return f"{sig.name}, {signal.strsignal(sig) or 'signal'}; {_HINTS.get(sig, 'see the messages above')}", sig.name
    return f"exit status {code}", None


class LlamaCppWorker:
    """One child process running llama.cpp calls for ``label`` (the file it works on, for messages)."""

    def __init__(self, label: str, timeout: float | None = None):
        self.label = label
        self.timeout = timeout
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child,), daemon=True, name=f"llama.cpp {label}")
        self._process.start()
        child.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def call(self, fn: Callable[..., Any], *args: Any, doing: str = "running") -> Any:
        """``fn(state, *args)`` in the child; its result, or a one-line error if it raised or died."""
        waited = 0.0
        try:
            self._conn.send((fn, args))
            while not self._conn.poll(0.2):  # a dead child's pipe polls ready too (EOF on recv)
                waited += 0.2
                if self.timeout is not None and waited > self.timeout:
                    self._process.kill()
                    self._process.join(5)
                    raise LlamaCppCrash(f"llama.cpp gave no answer {doing} {self.label} within {self.timeout:g} s: stopped it", "SIGKILL")
            status, value = self._conn.recv()
            if status == "ok":
                return value
            raise CompressError(f"llama.cpp failed {doing} {self.label}: {value}")
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass
        self._process.join(10)  # the pipe closed as the child died: wait for its exit status
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        what, name = describe_exit(self._process.exitcode)
        raise LlamaCppCrash(f"llama.cpp died {doing} {self.label} ({what})", name)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._conn.close()

    def __enter__(self) -> "LlamaCppWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- functions run in the child ---------------------------------------------------------------------
def _load(state: dict, path: str, ctx: int, threads: int) -> None:
    from llama_cpp import Llama

    state["llm"] = Llama(
        model_path=path, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False, n_threads=threads, seed=0
    )


def _scores(state: dict, windows: list[list[int]]) -> list[np.ndarray]:
    llm, out = state["llm"], []
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[: len(ids)], dtype=np.float32))
    return out


def _tokenize(state: dict, text: bytes, add_bos: bool, special: bool) -> list[int]:
    return state["llm"].tokenize(text, add_bos=add_bos, special=special)


def _complete(state: dict, prompt: str, max_tokens: int) -> dict:
    return state["llm"](prompt, max_tokens=max_tokens, temperature=0.0)


def _silence(state: dict) -> None:
    """Route llama.cpp's log lines (one per tensor when quantizing) to nowhere, once per child."""
    import llama_cpp

    if "log_sink" not in state:

        @llama_cpp.llama_log_callback
        def _drop(level, text, user_data):
            return None

        llama_cpp.llama_log_set(_drop, None)
        state["log_sink"] = _drop  # keep a reference: the C side holds only the pointer


def _quantize(state: dict, src: str, dst: str, ftype: int, pure: bool, threads: int) -> tuple[int, float]:
    import time

    import llama_cpp

    _silence(state)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = ftype, pure, threads
    start = time.perf_counter()
    code = int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params))
    return code, time.perf_counter() - start


def _system_info(state: dict) -> str:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


@dataclass
class _Logits:
    logits: Any  # torch.Tensor [batch, tokens, vocab]


class LlamaCppModel:
    """Adapter giving llama.cpp the ``model(input_ids=..., use_cache=False).logits`` call `evaluate` makes,
    the model living in a `LlamaCppWorker`. Each window is evaluated from an empty KV cache, on the token
    ids given (llama.cpp's tokenizer unused)."""

    def __init__(self, path: Path, ctx: int = 512, threads: int | None = None, timeout: float | None = None):
        self.path = Path(path)
        self.worker = LlamaCppWorker(self.path.name, timeout)
        try:
            self.worker.call(_load, str(self.path), ctx, threads or default_threads(), doing="loading")
        except BaseException:
            self.worker.close()
            raise

    def __call__(self, input_ids, use_cache: bool = False):
        import torch

        rows = self.worker.call(_scores, input_ids.tolist(), doing="evaluating")
        return _Logits(torch.from_numpy(np.stack(rows)))

    def scores(self, ids: list[int]) -> np.ndarray:
        """llama.cpp's logits for every position of ``ids`` fed from an empty cache, ``[len(ids), vocab]``."""
        return self.worker.call(_scores, [ids], doing="evaluating")[0]

    def tokenize(self, text: bytes, add_bos: bool = False, special: bool = False) -> list[int]:
        return self.worker.call(_tokenize, text, add_bos, special, doing="tokenizing with")

    def complete(self, prompt: str, max_tokens: int = 16) -> dict:
        """Greedy completion of ``prompt`` (llama-cpp-python's completion dict)."""
        return self.worker.call(_complete, prompt, max_tokens, doing="generating with")

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> "LlamaCppModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quantize(src: Path, dst: Path, ftype: int, pure: bool = True, threads: int | None = None) -> float:
    """``llama_model_quantize`` (what ``llama-quantize`` runs) of ``src`` into ``dst`` in a child process;
    the seconds it took there (the child's start not counted)."""
    with LlamaCppWorker(Path(src).name) as worker:
        code, seconds = worker.call(_quantize, str(src), str(dst), ftype, pure, threads or default_threads(), doing="quantizing")
    if code != 0:
        raise CompressError(f"llama_model_quantize returned {code} for {src}: see llama.cpp's messages above")
    return seconds


def system_info() -> str:
    """llama.cpp's ``llama_print_system_info``: the CPU features its build uses (``AVX2 = 1 | ...``)."""
    with LlamaCppWorker("system info") as worker:
        return worker.call(_system_info, doing="reporting")


@dataclass
class BuildCheck:
    system_info: str  # the features the build uses
    cpu_flags: list[str]  # the SIMD features this CPU reports (Linux /proc/cpuinfo)
    tokens: int  # tokens evaluated per file
    files: list[str]

    def summary(self) -> str:
        return (
            f"llama.cpp evaluated {self.tokens} tokens of {', '.join(self.files)} in a child process. "
            f"Build: {self.system_info}. CPU reports: {' '.join(self.cpu_flags) or 'unknown'}."
        )


NATIVE_BUILD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags(wanted: tuple[str, ...] = NATIVE_BUILD_FLAGS) -> list[str]:
    """Which of the ``wanted`` SIMD flags the CPU reports (Linux /proc/cpuinfo; by default what a native build of
    llama.cpp would pick up)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in wanted if f in flags]


def check_build(files: list[Path], tokens: int = 64) -> BuildCheck:
    """Evaluate ``tokens`` token ids through each (quantized) GGUF file in a child process: a batch large
    enough for ggml's matrix kernels (AMX, AVX-512) rather than its vector ones. Raises `LlamaCppCrash`
    naming the file and signal where the build cannot run here."""
    info = system_info()
    for path in files:
        with LlamaCppModel(path, ctx=max(tokens, 64)) as model:
            logits = model.scores(list(range(1, tokens + 1)))
            if not np.isfinite(logits).all():
                raise CompressError(f"llama.cpp gave non-finite logits for {path}: its build is broken, reinstall it")
    return BuildCheck(info, cpu_flags(), tokens, [Path(f).name for f in files])

