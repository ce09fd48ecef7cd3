"""Our encoders against ggml's own (``ggml_quantize_chunk`` in the libggml-base that llama-cpp-python
ships, called in a child process), on the same float32 input: the bytes should be the same, block for block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[gguf]'")

from compress.eval.llama_cpp_worker import LlamaCppWorker  # noqa: E402
from compress.formats.gguf.codecs import CODECS, decode_tensor, encode_tensor, needs_importance  # noqa: E402
from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType  # noqa: E402
from gguf_reference import ggml_quantize_chunk  # noqa: E402


@pytest.fixture(scope="module")
def ggml(llama_cpp_runs):
    """ggml's quantizer, called in a child process (`LlamaCppWorker`): a crash there fails the test only."""
    found = sorted(Path(llama_cpp.__file__).parent.rglob("libggml-base.*"))
    if not found:
        pytest.skip("llama-cpp-python ships no libggml-base library to call")
    with LlamaCppWorker(found[0].name) as worker:
        yield worker, str(found[0])


def ggml_encode(ggml, w: np.ndarray, kind: GGMLType, importance: np.ndarray | None = None) -> np.ndarray:
    worker, lib_path = ggml
    return worker.call(ggml_quantize_chunk, lib_path, w, int(kind), importance, doing="quantizing with")


def matrices():
    rng = np.random.default_rng(7)
    gauss = (rng.standard_normal((96, 1024)) * 0.02).astype(np.float32)
    gauss[3] *= 1e-3
    gauss[5, :256] = 0
    gauss[6, :256] = -0.0  # the sign of a zero scale: ggml's largest-magnitude loops start from +0
    gauss[7, 0:512:2], gauss[7, 1:512:2] = 0.03, -0.03  # ±ties of the largest magnitude: the first wins
    gauss[8, 256:512] = np.abs(gauss[8, 256:512])
    gauss[8, 300] = -gauss[8, 256:512].max()  # a −max after the +max, inside one block
    gauss[9:12, 16:32] *= 1e-4  # sub-blocks whose scale rounds to 0 in a live super-block: ggml keeps their fit's codes
    gauss[10, 512:528] = 0
    heavy = (rng.standard_t(3, size=(64, 512)) * 0.01).astype(np.float32)
    skewed = (np.abs(rng.standard_normal((32, 768))) * 0.05 + 0.01).astype(np.float32)
    return {"gaussian": gauss, "heavy-tailed": heavy, "all-positive": skewed}


BLOCKED = [k for k in CODECS if BLOCK_SIZES[k][0] > 1]
NEEDS_IMPORTANCE = {k for k in BLOCKED if needs_importance(k)}  # ggml asserts without one


@pytest.mark.parametrize("kind", [k for k in BLOCKED if k not in NEEDS_IMPORTANCE], ids=lambda k: k.name)
def test_our_bytes_are_ggml_bytes(ggml, kind):
    for label, w in matrices().items():
        ours, theirs = encode_tensor(w, kind), ggml_encode(ggml, w, kind)
        size = BLOCK_SIZES[kind][1]
        same = (ours.reshape(-1, size) == theirs.reshape(-1, size)).all(axis=1).mean()
        # float32 sums in ggml's order make the two agree exactly here; allow a stray near-tie
        assert same >= 0.999, f"{label}: {same:.4%} of blocks identical"
        cols = w.shape[1]
        err = np.sqrt(((decode_tensor(ours, kind, cols) - w) ** 2).mean())
        ref = np.sqrt(((decode_tensor(theirs, kind, cols) - w) ** 2).mean())
        assert err <= ref * 1.0001, (label, err, ref)


@pytest.mark.parametrize("kind", BLOCKED, ids=lambda k: k.name)
def test_importance_weighted_bytes_are_ggml_bytes(ggml, kind):
    """With an importance vector (an imatrix entry) ggml switches to its ``quantize_row_*_impl``
    solvers; ours must follow, and the importance-weighted error must drop below plain rounding's
    (for a type that needs an importance matrix: below a uniform one's)."""
    rng = np.random.default_rng(11)
    for label, w in matrices().items():
        importance = rng.gamma(0.5, 2.0, w.shape[1]).astype(np.float32)
        ours, theirs = encode_tensor(w, kind, importance), ggml_encode(ggml, w, kind, importance)
        size = BLOCK_SIZES[kind][1]
        same = (ours.reshape(-1, size) == theirs.reshape(-1, size)).all(axis=1).mean()
        assert same >= 0.999, f"{label}: {same:.4%} of blocks identical"
        cols = w.shape[1]
        weighted = np.sqrt((importance * (decode_tensor(ours, kind, cols) - w) ** 2).mean())
        uniform = np.ones_like(importance) if kind in NEEDS_IMPORTANCE else None
        plain = np.sqrt((importance * (decode_tensor(encode_tensor(w, kind, uniform), kind, cols) - w) ** 2).mean())
        assert weighted < plain or kind == GGMLType.Q8_0, (label, weighted, plain)
