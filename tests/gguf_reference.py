"""Independent views of a GGUF file for the tests: gguf-py's reader, transformers' loader, llama.cpp (always
in a child process: `compress.eval.llama_cpp_worker`), and ggml's own quantizer."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch


def read_fields(path: Path) -> dict:
    """Scalar and string-array metadata of a GGUF file, as gguf-py's reader decodes it."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except Exception:  # some field kinds have no python form; not needed here
            continue
    return out


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def transformers_model(path: Path):
    """The GGUF file loaded by transformers (it dequantizes with gguf-py and undoes the Q/K permutation)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def llamacpp_model(path: Path, n_ctx: int = 512):
    """llama.cpp's model of ``path``, living in a child process (a crash there fails the test, not pytest)."""
    from compress.eval.llama_cpp_worker import LlamaCppModel

    return LlamaCppModel(path, ctx=n_ctx, threads=2)


def llamacpp_window_log_probs(llm, tokens: list[int], windows) -> list[np.ndarray]:
    """llama.cpp's log-probabilities (float64) of the scored positions of each window, fed without BOS."""
    out = []
    for w in windows:
        logits = np.asarray(llm.scores(tokens[w.begin : w.end]), dtype=np.float64)
        logits = logits[w.score_from - w.begin - 1 : w.end - w.begin - 1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        out.append(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))
    return out


def llamacpp_perplexity(path: Path, tokens: list[int], ctx: int = 512) -> float:
    """Sliding-window perplexity from llama.cpp's own logits, windows as our evaluator cuts them."""
    from compress.eval.perplexity import sliding_windows

    windows = sliding_windows(len(tokens), ctx, ctx)
    llm = llamacpp_model(path, ctx)
    nll, count = 0.0, 0
    for w, lp in zip(windows, llamacpp_window_log_probs(llm, tokens, windows)):
        targets = np.asarray(tokens[w.score_from : w.end])
        nll -= lp[np.arange(len(targets)), targets].sum()
        count += len(targets)
    llm.close()
    return math.exp(nll / count)


def ggml_quantize_chunk(state: dict, lib_path: str, w: np.ndarray, kind: int, importance: np.ndarray | None) -> np.ndarray:
    """ggml's ``ggml_quantize_chunk`` of ``w`` (float32 ``[rows, cols]``) into ``kind``, called through ctypes
    in the libggml-base that llama-cpp-python ships. Runs in a `LlamaCppWorker` child (``state`` keeps the
    loaded library)."""
    import ctypes

    from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType

    if "ggml" not in state:
        lib = ctypes.CDLL(lib_path)
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ]
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        state["ggml"] = lib
    lib = state["ggml"]
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows, cols = w.shape
    block, size = BLOCK_SIZES[GGMLType(kind)]
    out = np.zeros((rows, cols // block * size), dtype=np.uint8)
    lib.ggml_quantize_init(kind)
    qw = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    lib.ggml_quantize_chunk(kind, w.ctypes.data, out.ctypes.data, 0, rows, cols, None if qw is None else qw.ctypes.data)
    return out
