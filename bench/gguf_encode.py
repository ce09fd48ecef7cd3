"""Encoding speed of our GGUF k-quant encoders next to llama.cpp's quantizer, on the same F16 file.

    python bench/gguf_encode.py [--model eval/assets/reference-llama | --random tinyllama --blocks 2] [--types q4_k q6_k q8_0]
                                [--threads 1]

Writes the model as an F16 GGUF with our exporter, then times both alike, from that file on disk to the encoded
bytes written to disk (what the disk cache holds is the same for both: the F16 file was just written):
- ours: every 2-D F16 tensor of that file, memory-mapped (`compress.checkpoints.gguf_file.mapped_tensors`),
  converted to float32 and encoded as the export encodes it (`compress.export.encoding_pool.export_encoder`: on
  ``--threads`` lanes, this process and worker processes started inside the timing, when the searched encodings
  are large enough, else in this process), its bytes written to a file (the process pinned to ``--threads`` CPUs,
  torch limited to as many threads, under the export's allocator policy, `compress.cli.allocator.STREAMING`);
- llama.cpp: ``llama_model_quantize`` (llama-cpp-python) of the same file with ``pure`` set, so every
  matrix gets the type, with ``--threads`` threads (wall time of the call: its reading, encoding and writing).
Speed is F16 megabytes in per second. Also checks that both wrote the same bytes. ``--random tinyllama --blocks 2`` writes (once, cached) a random checkpoint of
TinyLlama-1.1B's shapes (`bench/pipeline.py`'s `random_checkpoint`; 219 M weights, every width a multiple of 256,
so every matrix takes the k-quant), large enough for the encoding to repay starting worker processes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from compress.checkpoints.gguf_file import mapped_tensors
from compress.cli.allocator import allocator_policy, set_allocator
from compress.export.gguf import ExportConfig, export_gguf
from compress.export.encoding_pool import export_encoder, read_ahead
from compress.formats.gguf.plan import FILE_TYPE, PRESETS, Target
from compress.formats.gguf.sizes import GGMLType
from pipeline import RANDOM_SHAPES, random_checkpoint  # bench/pipeline.py, beside this script

REPO = Path(__file__).resolve().parents[1]
KINDS = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1, "q5_0": GGMLType.Q5_0, "q5_1": GGMLType.Q5_1,
         "q4_k": GGMLType.Q4_K, "q6_k": GGMLType.Q6_K, "q5_k": GGMLType.Q5_K, "q3_k": GGMLType.Q3_K, "q2_k": GGMLType.Q2_K,
         "iq4_nl": GGMLType.IQ4_NL, "iq4_xs": GGMLType.IQ4_XS, "iq3_s": GGMLType.IQ3_S}  # the types with a plain fit


def f16_matrices(path: Path) -> list:
    """The 2-D F16 tensors of ``path``, memory-mapped (not read yet)."""
    from gguf import GGMLQuantizationType

    return [t for t in mapped_tensors(path) if t.tensor_type == GGMLQuantizationType.F16 and len(t.shape) == 2]


def ours(path: Path, kind: GGMLType, out: Path) -> tuple[float, dict[str, bytes]]:
    """Seconds from the F16 file to ``out`` written: each matrix read, encoded and written in turn; and the bytes."""
    start = time.perf_counter()
    encoded = {}
    matrices = f16_matrices(path)
    with out.open("wb") as sink, export_encoder([(t.shape, kind) for t in matrices], False) as encoder:

        def read_tensor(tensor) -> list:  # read and handed to the encoder, as the export does (`read_ahead`)
            cols, rows = tensor.shape
            return [encoder.submit(np.asarray(tensor.data).view(np.float16).reshape(rows, cols), kind)]  # made float32 there

        for tensor, (data,) in zip(matrices, read_ahead((t.data.size, partial(read_tensor, t)) for t in matrices)):
            data.tofile(sink)  # as the export writes it
            encoded[tensor.name] = data
    seconds = time.perf_counter() - start
    return seconds, {k: v.tobytes() for k, v in encoded.items()}


def llama_cpp_quantize(src: Path, dst: Path, target: Target, threads: int) -> float:
    """Seconds ``llama_model_quantize`` took (run in a child process: a crash there is one line); ``--pure``
    (every matrix in the target's type) unless the target is one of llama.cpp's mixes (q4_k_m ...)."""
    from compress.eval.llama_cpp_worker import quantize

    return quantize(src, dst, FILE_TYPE[target], pure=target not in PRESETS, threads=threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "eval" / "assets" / "reference-llama")
    ap.add_argument("--random", choices=sorted(RANDOM_SHAPES), help="a random-weight checkpoint of these shapes instead")
    ap.add_argument("--blocks", type=int, default=2, help="its decoder blocks (--random)")
    ap.add_argument("--types", nargs="+", default=["q4_k", "q6_k"], choices=sorted(KINDS))
    ap.add_argument("--threads", type=int, default=1, help="CPUs for ours and llama.cpp quantize threads")
    args = ap.parse_args()
    import os

    import torch

    if hasattr(os, "sched_setaffinity"):  # encode_tensor runs as many workers as the CPUs it may use
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
    torch.set_num_threads(args.threads)
    set_allocator(allocator_policy("export"))  # ours runs as `compress export` does (llama.cpp's in its own process)
    from gguf import GGUFReader

    if args.random:
        args.model = random_checkpoint(args.random, args.blocks)
    with tempfile.TemporaryDirectory() as tmp:
        f16 = Path(tmp) / "model-f16.gguf"
        export_gguf(ExportConfig(args.model, f16, Target.f16))
        matrices = f16_matrices(f16)
        megabytes = sum(t.data.nbytes for t in matrices) / 1e6
        print(f"model {args.model}: {len(matrices)} F16 matrices, {megabytes:.1f} MB; llama.cpp threads {args.threads}")
        print(f"{'type':6s} {'ours MB/s':>10s} {'llama.cpp MB/s':>15s} {'ours/llama.cpp':>15s}  tensors with the same bytes")
        for name in args.types:
            kind, target = KINDS[name], Target(name)
            ours_s, ours_bytes = ours(f16, kind, Path(tmp) / f"ours-{name}.bin")
            dst = Path(tmp) / f"llamacpp-{name}.gguf"
            theirs_s = llama_cpp_quantize(f16, dst, target, args.threads)
            theirs = {t.name: np.array(t.data).tobytes() for t in GGUFReader(str(dst)).tensors if t.name in ours_bytes}
            same = sum(theirs[k] == v for k, v in ours_bytes.items())
            print(f"{name:6s} {megabytes / ours_s:10.2f} {megabytes / theirs_s:15.2f} {theirs_s / ours_s:15.3f}  {same}/{len(ours_bytes)}")


if __name__ == "__main__":
    main()
