"""Dispatch from a `GGMLType` to its codec, and whole-tensor encode/decode in row chunks.

Every codec module exposes ``encode(blocks [N, block] float32) -> [N, type_size] uint8`` and
``decode([N, type_size] uint8) -> [N, block] float32``. Here a 2-D weight ``[rows, cols]`` (ggml's
``ne = [cols, rows]``; ``cols`` is the contiguous axis and must be a multiple of the block size) is
cut into blocks along each row and encoded `chunk_elements` weights at a time, bounding the
solvers' temporaries.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Callable

import numpy as np
import torch

from compress.errors import CompressError
from compress.formats.gguf._common import float32_of, mean_square
from compress.formats.gguf import bf16, f16, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs, iq4_nl, iq4_xs, q2_k, q3_k, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0
from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType
from compress.quantizers.threads import one_thread, one_thread_workers

CODECS: dict[GGMLType, ModuleType] = {
    m.KIND: m for m in (f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, iq3_s, iq3_xxs, iq2_xxs, iq2_xs, iq2_s)
}
# Elements per encoding task. One worker: the solvers' temporaries stay near the cache, each task's ~100+ small
# operations not too many (one thread, 2816 x 2048 F16: Q4_K 24-31 MB/s at 2^16, 33-34 at 2^17, 28 at 2^18; Q3_K
# 33-35 / 43 / 41; Q5_K 36-37 / 40-42 / 33; 2^23 was 1.9x slower). A direct rounding has no search to keep in cache
# and few operations per task, so larger tasks (2^19: Q8_0 655 -> 979 MB/s, Q4_0 494 -> 736 from 2^16). Several
# workers (a thread pool: numpy and torch release the GIL, but each small operation takes it back): chunks of 2^19,
# or the workers queue on the GIL (Q4_K on a 2048 x 4096 matrix, 2 cores: 1 worker 50 MB/s, 2 workers at 2^16
# 35 MB/s, at 2^18 58 MB/s, Q4_0 at 2^19 1.5x).
CHUNK_ELEMENTS = 1 << 17
DIRECT_CHUNK_ELEMENTS = 1 << 19
POOL_CHUNK_ELEMENTS = 1 << 19
# A searched encoding of 2^18 to 2^20 weights (GGUF-GPTQ fits one 256-column super-block of a layer's rows at a time:
# 2048 rows are 2^19) is split into parts of at least this many, one per CPU, rather than left on one thread
# (`bench/gptq_speed.py --shapes 2048x2048 --skip-slow --gguf q4_k q6_k`, 2 cores, alternating: Q4_K 0.87-0.90 ->
# 0.78-0.85 s, 2.2-2.3x -> 2.0-2.1x integer GPTQ; encode_tensor of 1024 x 512 on 2 threads: Q4_K 30 -> 22 ms, Q3_K
# 24 -> 17). A direct rounding's task (~1 ns a weight) stays one `DIRECT_CHUNK_ELEMENTS` on one thread.
MIN_PART_ELEMENTS = 1 << 18


def encoding_cpus() -> int:
    """The CPUs an encoding may keep busy: those this process may run on (its affinity: ``taskset``, a container's
    cpuset), at most torch's thread count (processes sharing a machine set that: a pool of their own would
    oversubscribe the cores)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(usable, torch.get_num_threads())


def rounds_directly(kind: GGMLType, weighted: bool = False) -> bool:
    """True where ``kind``'s encoding (importance-weighted if ``weighted``) rounds each block at once, with no search
    over candidate scales (a codec's ``DIRECT_ROUNDING``): the legacy types' plain encoders, and Q8_0's, which has no
    weighted one (ggml ignores the importance there). ~1 ns a weight, against 30-100+ for the searches."""
    codec = CODECS.get(kind)
    return getattr(codec, "DIRECT_ROUNDING", False) and not (weighted and hasattr(codec, "encode_weighted"))


def chunk_elements(kind: GGMLType, weighted: bool = False) -> int:
    """Weights per encoding task on one worker (`CHUNK_ELEMENTS`; `DIRECT_CHUNK_ELEMENTS` for a direct rounding)."""
    return DIRECT_CHUNK_ELEMENTS if rounds_directly(kind, weighted) else CHUNK_ELEMENTS


def needs_importance(kind: GGMLType) -> bool:
    """True for the types ggml encodes only with an importance matrix (IQ2_XXS, IQ2_XS)."""
    return getattr(CODECS.get(kind), "NEEDS_IMPORTANCE", False)


def plain_importance(kind: GGMLType, shape: tuple[int, ...]) -> np.ndarray | None:
    """The importance of a plain (unweighted) encoding of weights of ``shape``: None, or for the types ggml only
    encodes with one, a uniform one (what a flat imatrix gives)."""
    return np.ones(shape, dtype=np.float32) if needs_importance(kind) else None


def round_trip(weight: np.ndarray, kind: GGMLType) -> np.ndarray:
    """``decode(encode(weight))`` ``[rows, cols]`` in ``kind`` by ggml's plain encoder (a flat importance where
    ggml needs one)."""
    cols = weight.shape[-1]
    return decode_tensor(encode_tensor(weight, kind, plain_importance(kind, (cols,))), kind, cols)


def _functions(kind: GGMLType):
    if kind == GGMLType.F32:
        return f16.encode_f32, f16.decode_f32
    if kind not in CODECS:
        raise CompressError(f"GGML type {kind.name} has no encoder here: use one of {', '.join(k.name for k in CODECS)}")
    return CODECS[kind].encode, CODECS[kind].decode


def check_shape(kind: GGMLType, cols: int, name: str = "tensor") -> None:
    block = BLOCK_SIZES[kind][0]
    if cols % block:
        raise CompressError(
            f"{name}: rows of {cols} values cannot be stored as {kind.name} (blocks of {block}): "
            "choose a type whose block size divides it (e.g. q8_0 or f16)"
        )


def encode_tensor(weight: np.ndarray, kind: GGMLType, importance: np.ndarray | None = None) -> np.ndarray:
    """``[rows, cols]`` (or 1-D) float -> ``[rows, row_bytes]`` uint8 in ``kind``'s block format. Float16 weights
    (an F16 file's, memory-mapped) are made float32 a chunk at a time, with no float32 copy of the whole tensor
    (bench/gguf_encode.py, TinyLlama-shaped, one thread: Q8_0 215-230 -> 227-296 MB/s).

    ``importance`` (``[cols]``, e.g. an imatrix entry: the mean squared input activation of each
    column) switches to ggml's importance-weighted quantizers (``quantize_row_*_impl``); Q8_0 and the
    float types ignore it, as ggml does.
    """
    w = np.asarray(weight)
    if w.dtype != np.float16 or importance is not None:  # float16 is made float32 chunk by chunk, below
        w = float32_of(w)
    w2 = w.reshape(1, -1) if w.ndim == 1 else w.reshape(-1, w.shape[-1])
    check_shape(kind, w2.shape[1])
    encode, _ = _functions(kind)
    block, size = BLOCK_SIZES[kind]
    blocks = w2.reshape(-1, block)
    if importance is None and needs_importance(kind):
        raise CompressError(f"{kind.name} needs an importance matrix (ggml has no fit without one): pass an imatrix (--imatrix or --calib)")
    weighted = importance is not None and hasattr(CODECS.get(kind), "encode_weighted")
    if weighted:
        importance = np.asarray(importance, dtype=np.float32).reshape(-1)
        if importance.shape[0] != w2.shape[1]:
            raise CompressError(
                f"importance vector has {importance.shape[0]} entries for rows of {w2.shape[1]}: use the imatrix of this model"
            )
        qw = np.broadcast_to(importance, w2.shape).reshape(-1, block)
        # legacy types weigh by the whole row's mean square (ggml's sigma2 over n_per_row)
        row_sigma2 = np.repeat(mean_square(w2), w2.shape[1] // block, axis=0)
        encode_weighted = CODECS[kind].encode_weighted
    out = np.empty((blocks.shape[0], size), dtype=np.uint8)

    def work(part: slice) -> None:
        out[part] = encode_weighted(blocks[part], qw[part], row_sigma2[part]) if weighted else encode(float32_of(blocks[part]))

    in_chunks(blocks.shape[0], block, work, chunk_elements(kind, weighted))
    return out.reshape(w2.shape[0], -1)


def plan_parts(n: int, block: int, chunk: int, cpus: int) -> tuple[int, list[slice]]:
    """`in_chunks`' threads and parts for ``n`` blocks of ``block`` weights on up to ``cpus`` threads."""
    workers = max(1, min(n * block // max(chunk, MIN_PART_ELEMENTS), cpus))
    step = max(1, min(POOL_CHUNK_ELEMENTS // block, -(-n // workers)) if workers > 1 else chunk // block)
    return workers, [slice(start, min(start + step, n)) for start in range(0, n, step)]


def in_chunks(n: int, block: int, work: Callable[[slice], None], chunk: int = CHUNK_ELEMENTS) -> None:
    """``work(part)`` over ``n`` blocks of ``block`` weights, ``part`` a slice of them: ``chunk`` weights at a time on
    one worker, or on a thread pool of up to `encoding_cpus` threads, each given at least ``max(chunk,
    MIN_PART_ELEMENTS)`` weights, `POOL_CHUNK_ELEMENTS` at a time (fewer where that leaves a thread idle)."""
    workers, parts = plan_parts(n, block, chunk, encoding_cpus())
    # torch's intra-op threads off: the chunks already run on a pool, and torch splitting each small op over
    # its threads too only added fork/join overhead (Q8_0 1.7x slower with 2 torch threads in each of 2 workers);
    # the workers set it for themselves (`one_thread_workers`): a new thread starts with OpenMP's default team
    with one_thread(torch.device("cpu")):
        if workers <= 1:
            for part in parts:
                work(part)
        else:
            with one_thread_workers(workers) as pool:
                list(pool.map(work, parts))


def decode_tensor(data: np.ndarray, kind: GGMLType, cols: int, out: np.ndarray | None = None) -> np.ndarray:
    """``[rows, row_bytes]`` uint8 -> ``[rows, cols]`` float32 (into ``out``, a C-contiguous float32 ``[rows, cols]``,
    where given); a large tensor's blocks in parts (`in_chunks`), each decoded alone (the decoders are per block: the
    same values), so that no temporary is the whole tensor's."""
    _, decode = _functions(kind)
    block, size = BLOCK_SIZES[kind]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)
    if out is None:
        out = np.empty((blocks.shape[0], block), dtype=np.float32)
    elif out.dtype != np.float32 or not out.flags.c_contiguous or out.size != blocks.shape[0] * block:
        raise ValueError(f"decode_tensor's out must be C-contiguous float32 [{data.shape[0]}, {cols}]")
    out = out.reshape(-1, block)

    def work(part: slice) -> None:
        out[part] = decode(blocks[part])

    in_chunks(blocks.shape[0], block, work, DIRECT_CHUNK_ELEMENTS)
    return out.reshape(-1, cols)
