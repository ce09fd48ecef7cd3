"""`tensor_infos` (the header walked with the metadata values skipped) against gguf-py's reader, which parses them."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from compress.checkpoints.gguf_file import dequantized, mapped_tensors, read_gguf, tensor_infos
from compress.errors import CompressError

gguf = pytest.importorskip("gguf")


def _write(path: Path, alignment: int | None = None, vocab: int = 3000) -> Path:
    from compress.formats.gguf.codecs import encode_tensor
    from compress.formats.gguf.sizes import GGMLType, row_bytes

    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:  # the key, and the writer's own padding to it
        writer.add_uint32("general.alignment", alignment)
        writer.data_alignment = alignment
    writer.add_block_count(2)
    writer.add_string("general.name", "ünïcode ✓")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 7) for i in range(vocab)])  # empty strings too
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(vocab)])
    writer.add_array("tokenizer.ggml.token_type", [i % 5 for i in range(vocab)])
    writer.add_bool("some.flag", True)
    writer.add_float64("some.double", 0.5)
    writer.add_int64("some.int64", -3)
    rng = np.random.default_rng(0)
    writer.add_tensor("norm.weight", rng.standard_normal(96).astype(np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((3, 64)).astype(np.float16))
    for kind in (GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K):
        rows = rng.standard_normal((5, 512)).astype(np.float32)
        writer.add_tensor(f"{kind.name}.weight", encode_tensor(rows, kind), raw_shape=[5, row_bytes(kind, 512)],
                          raw_dtype=gguf.GGMLQuantizationType(kind.value))
    writer.add_tensor("cube.weight", rng.standard_normal((2, 3, 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 8])
def test_tensors_as_gguf_py_reads_them(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment)
    reference = read_gguf(path)
    ours = tensor_infos(path)
    assert [(t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in ours] == [
        (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes)) for t in reference.tensors
    ]
    assert all(t.data_offset % (alignment or 32) == 0 for t in ours)
    for mine, theirs in zip(mapped_tensors(path), reference.tensors):
        np.testing.assert_array_equal(dequantized(path, mine).reshape(-1), dequantized(path, theirs).reshape(-1))


def test_bad_headers_are_one_line_errors(tmp_path):
    good = _write(tmp_path / "good.gguf", vocab=10).read_bytes()
    cases = {
        "version 1": good[:4] + struct.pack("<I", 1) + good[8:],
        "big-endian": good[:4] + struct.pack(">I", 3) + good[8:],
        "a billion tensors": good[:8] + struct.pack("<Q", 10**9) + good[16:],
        "cut in the metadata": good[:200],
        "not GGUF": b"GGML" + good[4:],
    }
    for label, data in cases.items():
        path = tmp_path / f"{label}.gguf"
        path.write_bytes(data)
        with pytest.raises(CompressError) as err:
            tensor_infos(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value), label


def test_bad_alignment_and_truncated_data(tmp_path):
    with pytest.raises(CompressError, match="alignment"):
        tensor_infos(_write(tmp_path / "odd.gguf", alignment=48))
    path = _write(tmp_path / "cut.gguf", vocab=10)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert tensor_infos(path)[-1].data_offset + tensor_infos(path)[-1].n_bytes > len(data) - 100  # the header is whole
    with pytest.raises(CompressError, match="truncated"):
        mapped_tensors(path)
