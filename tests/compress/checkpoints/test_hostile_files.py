"""Hostile input files: each is a one-line error naming the file and the problem, exit status 2 from the CLI,
nothing written, no code run, and no allocation the file asks for before it is checked."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from compress.checkpoints.shards import CheckpointReader
from compress.cli import app
from compress.errors import CompressError
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL


class _Exploit:
    """Unpickling this runs os.system: what a malicious pytorch_model.bin carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickle_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(REFERENCE_MODEL / "config.json", model / "config.json")
    with (model / "pytorch_model.bin").open("wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Exploit(marker)}, f)
    assert not marker.exists()
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(tmp_path / "out")])
    assert done.exit_code == 2 and "weights_only" in done.output and "pytorch_model.bin" in done.output
    assert not marker.exists() and not (tmp_path / "out").exists()
    pickle.loads(pickle.dumps(_Exploit(marker)))  # the control: unpickled by plain pickle, it does run
    assert marker.exists()


def _safetensors(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
LIES = {
    "offsets out of bounds": ({"a": {**F32, "data_offsets": [0, 1 << 40]}}, "truncated"),
    "offsets backwards": ({"a": {**F32, "data_offsets": [16, 0]}}, "invalid data_offsets"),
    "offsets not integers": ({"a": {**F32, "data_offsets": ["0", 16]}}, "invalid data_offsets"),
    "overlapping tensors": ({"a": F32, "b": {**F32, "data_offsets": [8, 24]}}, "overlap"),
    "shape larger than its bytes": ({"a": {**F32, "shape": [1 << 20, 1 << 20]}}, "bytes of data"),
    "negative shape": ({"a": {**F32, "shape": [-1, 4]}}, "invalid shape"),
    "unknown dtype": ({"a": {**F32, "dtype": "Q4"}}, "unsupported dtype"),
    "duplicate names": (b'{"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "duplicate key"),
    "not UTF-8": (b'{"\xff\xfe": 1}', "corrupt safetensors header"),
    "deeply nested JSON": (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
}


@pytest.mark.parametrize("case", LIES)
def test_safetensors_headers_that_lie(tmp_path, case):
    header, words = LIES[case]
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(REFERENCE_MODEL / "config.json", model / "config.json")
    _safetensors(model / "model.safetensors", header, bytes(32))
    with pytest.raises(CompressError, match=words) as err:
        CheckpointReader(model)
    assert "\n" not in str(err.value) and "model.safetensors" in str(err.value)
    done = CliRunner().invoke(app, ["inspect", str(model)])
    assert done.exit_code == 2 and "Traceback" not in done.output


@pytest.mark.parametrize("length", [1 << 33, 100], ids=["8 GB header length", "header longer than the file"])
def test_header_lengths_beyond_the_file(tmp_path, length):
    path = _safetensors(tmp_path / "model.safetensors", {"a": F32}, length=length)
    with pytest.raises(CompressError, match="truncated: its header needs"):
        CheckpointReader(tmp_path)
    assert path.stat().st_size < 200


def test_a_valid_file_still_reads(tmp_path):
    save_file({"a": torch.arange(4.0).reshape(2, 2), "b": torch.ones(3, dtype=torch.int8)}, tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.get("a"), torch.arange(4.0).reshape(2, 2)) and reader.get("b").tolist() == [1, 1, 1]


@pytest.mark.parametrize("content, words", [(b"", "empty"), (b"\x00\x01\x02binary" * 50, "binary"), ("caf\u00e9 ".encode("latin-1") * 50, "not UTF-8")])
def test_calibration_files_that_are_not_text(tmp_path, content, words):
    calib = tmp_path / "calib.txt"
    calib.write_bytes(content)
    done = CliRunner().invoke(app, ["quantize", str(REFERENCE_MODEL), "-o", str(tmp_path / "out"), "--method", "gptq",
                                    "--calib", str(calib), "--samples", "2", "--seq-len", "32"])
    assert done.exit_code == 2 and words in done.output and "calib.txt" in done.output
    assert not (tmp_path / "out").exists()


def test_outputs_at_or_inside_the_input_are_refused(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(REFERENCE_MODEL, model)
    before = sorted(p.name for p in model.iterdir())
    (tmp_path / "link").symlink_to(model)
    runner = CliRunner()
    for out in (model, model / "quantized", tmp_path / "link"):
        done = runner.invoke(app, ["quantize", str(model), "-o", str(out), "--overwrite"])
        assert done.exit_code == 2 and "input model" in done.output, done.output
    done = runner.invoke(app, ["export", str(model), "-o", str(model / "model.gguf")])
    assert done.exit_code == 2 and "inside the input model" in done.output
    assert sorted(p.name for p in model.iterdir()) == before


# -- config.json and weights that do not fit, and checkpoints without a tokenizer -------------------------
def _one_line_failure(args: list) -> str:
    done = CliRunner().invoke(app, [str(a) for a in args])
    assert done.exit_code == 2 and "Traceback" not in done.output, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1, done.output
    return lines[0]


def _copy(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "model"))


def test_remote_code_runs_only_with_trust_remote_code(tmp_path, tiny_llama):
    model, marker = _copy(tiny_llama, tmp_path), tmp_path / "pwned"
    (model / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    line = _one_line_failure(["quantize", model, "-o", tmp_path / "out", "--group-size", "32", "--json"])
    assert "auto_map: modeling_evil.EvilForCausalLM" in line and "--trust-remote-code" in line
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["quantize", "--group-size", "32"], ["export", "--type", "q8_0"]], ids=["quantize", "export"])
def test_config_sizes_that_disagree_with_the_weights(tmp_path, tiny_llama, command):
    model = _copy(tiny_llama, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights have 128
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / ("out.gguf" if command[0] == "export" else "out")
    line = _one_line_failure([command[0], model, "-o", out, *command[1:], "--json"])
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape [128, 64] in the weights but config.json implies [96, 64]" in line
    assert os.listdir(tmp_path) == ["model"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["NaN", "Inf"])
def test_a_weight_with_nan_or_inf_is_named(tmp_path, tiny_llama, value):
    from safetensors.torch import load_file

    model = _copy(tiny_llama, tmp_path)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    line = _one_line_failure(["quantize", model, "-o", tmp_path / "out", "--group-size", "32", "--json"])
    assert "tensor model.layers.1.mlp.down_proj.weight holds 1 NaN or Inf values of 8192" in line and "model.safetensors" in line
    assert os.listdir(tmp_path) == ["model"]
    assert "model.layers.1.mlp.down_proj.weight" in _one_line_failure(["export", model, "-o", tmp_path / "m.gguf", "--json"])


def test_a_missing_tokenizer_matters_only_where_text_is_tokenized(tmp_path, tiny_llama):
    model = _copy(tiny_llama, tmp_path)
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(tmp_path / "rtn"), "--group-size", "32", "--json"])
    assert done.exit_code == 0, done.output  # no text to tokenize: no tokenizer needed
    calib = ["--calib", str(CALIB_TEXT), "--samples", "2", "--seq-len", "32"]
    for args in (["quantize", model, "-o", tmp_path / "gptq", "--method", "gptq", "--group-size", "32", *calib, "--json"],
                 ["eval", "ppl", tmp_path / "rtn", "--text", EVAL_TEXT, "--json"]):
        line = _one_line_failure(args)
        assert "has no tokenizer files" in line and "copy those files from the original checkpoint" in line, line
    assert "GGUF export needs the tokenizer" in _one_line_failure(["export", model, "-o", tmp_path / "m.gguf", "--json"])
