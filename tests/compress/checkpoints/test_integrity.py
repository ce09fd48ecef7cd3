"""Manifests, provenance and `compress verify`: every output carries the SHA-256 of its files and tensors;
damage (a flipped byte, a truncated or deleted file, an added one) is one line naming the file and the
first damaged tensor, exit status 2; every tensor is re-read, packed ones decoded through their codec.
Digests are checked against `hashlib` on the files' bytes, tensor ranges against the safetensors and
gguf-py readers."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from compress.checkpoints.integrity import MANIFEST, verify, write_manifest
from compress.cli import app
from compress.errors import CompressError
from compress.export.gguf import PROVENANCE_KEY, ExportConfig, export_gguf
from compress.formats.gguf.plan import Target
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tiny_tokenizer) -> Path:
    from conftest import save_random_model, tiny_llama_config

    return save_random_model(tiny_llama_config(len(tiny_tokenizer)), tmp_path_factory.mktemp("tiny"), tiny_tokenizer)


@pytest.fixture(scope="module")
def packed_once(tmp_path_factory, tiny_model) -> Path:
    out = tmp_path_factory.mktemp("packed") / "gptq"
    recipe = {"model": str(tiny_model), "stages": [{"method": "gptq", "bits": 4, "group_size": 32}],
              "calibration": {"path": str(CALIB_TEXT), "samples": 2, "seq_len": 32}, "output": {"path": str(out)}}
    run_recipe(parse_recipe(recipe), command="compress quantize ...")
    return out


@pytest.fixture
def packed(tmp_path, packed_once) -> Path:
    """A GPTQ output (compressed-tensors, packed) of its own, to damage."""
    return Path(shutil.copytree(packed_once, tmp_path / "gptq"))


def _tensor_range(path: Path, name: str) -> tuple[int, int]:
    """[begin, end) of a tensor's bytes in a safetensors file, from the format's own header layout."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + length])[name]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def _verify_fails(path: Path) -> str:
    done = CliRunner().invoke(app, ["verify", str(path), "--json"])
    assert done.exit_code == 2 and "Traceback" not in done.output, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1, done.output
    return lines[0]


def test_the_manifest_lists_every_file_and_tensor(packed):
    manifest = json.loads((packed / MANIFEST).read_text())["files"]
    files = sorted(p.name for p in packed.iterdir() if p.name != MANIFEST)
    assert sorted(manifest) == files and all(manifest[f]["sha256"] == _sha(packed / f) for f in files)
    weights = packed / "model.safetensors"
    with safe_open(weights, "pt") as f:
        names = sorted(f.keys())
    tensors = manifest["model.safetensors"]["tensors"]
    assert sorted(tensors) == names
    for name in names[:5]:
        begin, end = _tensor_range(weights, name)
        assert tensors[name]["sha256"] == hashlib.sha256(weights.read_bytes()[begin:end]).hexdigest()
    result = verify(packed)
    assert result.files == len(files) and result.tensors == len(names) and result.packed_layers == 14
    done = CliRunner().invoke(app, ["verify", str(packed)])
    assert done.exit_code == 0 and "intact" in done.output


def test_a_flipped_byte_names_the_file_and_tensor(packed):
    weights = packed / "model.safetensors"
    begin, end = _tensor_range(weights, "model.layers.1.mlp.up_proj.weight_packed")
    raw = bytearray(weights.read_bytes())
    raw[(begin + end) // 2] ^= 0x10
    weights.write_bytes(bytes(raw))
    line = _verify_fails(packed)
    assert f"{weights}: tensor model.layers.1.mlp.up_proj.weight_packed does not match its SHA-256" in line


def test_a_changed_header_byte(packed):
    weights = packed / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[raw.index(b'"format"') + 2] = ord("F")  # a metadata key: still a valid header
    weights.write_bytes(bytes(raw))
    assert "does not match its SHA-256 in the manifest (outside the tensor data)" in _verify_fails(packed)


def test_a_truncated_file(packed):
    weights = packed / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 100])
    line = _verify_fails(packed)
    assert f"{weights} is truncated ({size - 100} of {size} bytes): tensor" in line and "is cut off" in line


def test_a_deleted_and_a_replaced_file(packed):
    (packed / "tokenizer.json").unlink()
    assert f"{packed / 'tokenizer.json'} is missing" in _verify_fails(packed)
    (packed / "tokenizer.json").write_text("{}")
    assert "tokenizer.json has 2 bytes but the manifest says" in _verify_fails(packed)


def test_an_added_file(packed):
    (packed / "extra.bin").write_bytes(b"x")
    assert f"{packed / 'extra.bin'} is not in the manifest" in _verify_fails(packed)


def test_no_manifest(packed):
    (packed / MANIFEST).unlink()
    assert "has no manifest (manifest.json)" in _verify_fails(packed)


def test_damage_under_a_matching_manifest_is_found_by_rereading(packed):
    """A file damaged before its manifest was written: the digests agree, the codec does not."""
    from safetensors.torch import load_file, save_file

    weights = load_file(packed / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.weight_scale"][2, 0] = float("nan")
    save_file(weights, packed / "model.safetensors", metadata={"format": "pt"})
    write_manifest(packed)
    assert "tensor model.layers.0.self_attn.o_proj.weight_scale holds 1 NaN or Inf" in _verify_fails(packed)
    weights["model.layers.0.self_attn.o_proj.weight_scale"][2, 0] = 0.0
    weights["model.layers.0.self_attn.o_proj.weight_shape"][0] = 65
    save_file(weights, packed / "model.safetensors", metadata={"format": "pt"})
    write_manifest(packed)
    assert "model.layers.0.self_attn.o_proj.weight_shape says [65, 64] but the model has [64, 64]" in _verify_fails(packed)


def test_the_record_traces_the_inputs(packed, tiny_model):
    record = json.loads((packed / "config.json").read_text())["compression"]
    assert record["tool_version"] and record["command"] == "compress quantize ..." and "created" not in record
    assert record["inputs"]["model"]["sha256"]["model.safetensors"] == _sha(tiny_model / "model.safetensors")
    assert record["inputs"]["calibration"]["sha256"] == {CALIB_TEXT.name: _sha(CALIB_TEXT)}
    card = (packed / "README.md").read_text()
    assert _sha(tiny_model / "model.safetensors") in card and _sha(CALIB_TEXT) in card and "compress verify gptq" in card


def test_gguf_files_carry_a_sidecar_manifest_and_their_provenance(tmp_path, tiny_model):
    import gguf

    out = tmp_path / "model.gguf"
    export_gguf(ExportConfig(tiny_model, out, Target.q4_0, command="compress export x"))
    sidecar = tmp_path / "model.gguf.manifest.json"
    entry = json.loads(sidecar.read_text())["files"]["model.gguf"]
    assert entry["sha256"] == _sha(out) and entry["bytes"] == out.stat().st_size
    reader = gguf.GGUFReader(out)
    field = reader.fields[PROVENANCE_KEY]
    record = json.loads(bytes(field.parts[field.data[0]]).decode())
    assert record["command"] == "compress export x" and record["type"] == "q4_0"
    assert record["inputs"]["model"]["sha256"]["model.safetensors"] == _sha(tiny_model / "model.safetensors")
    for tensor in reader.tensors:  # the spans are gguf-py's own
        data = out.read_bytes()[tensor.data_offset : tensor.data_offset + tensor.n_bytes]
        assert entry["tensors"][tensor.name]["sha256"] == hashlib.sha256(data).hexdigest()
    assert verify(out).tensors == len(reader.tensors)

    target = reader.tensors[5]
    raw = bytearray(out.read_bytes())
    raw[target.data_offset + 3] ^= 0xFF
    out.write_bytes(bytes(raw))
    assert f"{out}: tensor {target.name} does not match its SHA-256" in _verify_fails(out)
    out.write_bytes(bytes(raw[: target.data_offset + 10]))
    assert "is truncated" in _verify_fails(out)
    sidecar.unlink()
    with pytest.raises(CompressError, match="has no manifest"):
        verify(out)


def test_digests_in_many_windows_are_the_whole_files_and_tensors(tmp_path, monkeypatch):
    """The file's digest is taken on a helper thread, window by window, beside each tensor's: with windows much
    smaller than the tensors (and tensors not aligned to them) both are still hashlib's digests of the same bytes."""
    import mmap

    import torch
    from safetensors.torch import save_file

    from compress.checkpoints import integrity

    path = tmp_path / "model.safetensors"
    save_file({f"t{i}": torch.randn(3000 + 37 * i) for i in range(6)}, str(path))
    monkeypatch.setattr(integrity, "WINDOW", mmap.ALLOCATIONGRANULARITY)  # the smallest a mapping's offset allows
    entry = integrity.file_entry(path)
    data = path.read_bytes()
    assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
    for name, tensor in entry["tensors"].items():
        span = data[tensor["offset"] : tensor["offset"] + tensor["bytes"]]
        assert tensor["sha256"] == hashlib.sha256(span).hexdigest(), name


def test_digests_of_spans_across_the_mapped_windows_equal_hashlib_over_the_bytes(tmp_path, monkeypatch):
    """The file's digest and each span's, hashed window by window from the mapped file, against hashlib over the
    file's bytes: spans inside a window, across a boundary, empty ones, and ones the file ends inside or before."""
    import hashlib
    import mmap
    import os

    from compress.checkpoints import integrity

    monkeypatch.setattr(integrity, "WINDOW", 16 * mmap.ALLOCATIONGRANULARITY)
    w = integrity.WINDOW
    data = os.urandom(4 * w + 1)
    path = tmp_path / "x.bin"
    path.write_bytes(data)
    for spans in ([(0, 10, "a"), (w - 6, w + 4400, "b"), (w + 4400, w + 4400, "e"), (w + 5000, 4 * w + 1, "c"), (4 * w + 1, 4 * w + 1, "z")],
                  [(0, w, "a"), (w, 2 * w, "b"), (4 * w - 10, 6 * w, "late")], [(5 * w, 5 * w + 10, "after")], []):
        whole, tensors = integrity._digests(path, spans)
        assert whole == hashlib.sha256(data).hexdigest()
        assert tensors == {n: hashlib.sha256(data[b:e]).hexdigest() if e <= len(data) else None for b, e, n in spans}
    assert integrity.sha256_file(path) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert integrity._digests(tmp_path / "empty", [(0, 0, "e"), (0, 5, "x")]) == (hashlib.sha256().hexdigest(), {"e": hashlib.sha256().hexdigest(), "x": None})
