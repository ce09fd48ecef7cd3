"""`compress report`: one protocol for every output (checkpoint rows equal `compress eval ppl`), GGUF through
llama.cpp and through gguf-py dequantization against transformers' own GGUF loader, the rendered files."""

from __future__ import annotations

import base64
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from compress.cli import app
from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs, nominal_bits, unpermute_rope
from compress.eval.report_render import XAxis, YAxis, pareto_front, write_report
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import EVAL_TEXT, REFERENCE_MODEL
from references import one_line_error

runner = CliRunner()


def quantize(model: Path, out: Path, fmt: str = "compressed-tensors", bits: int = 4, group: int = 32) -> Path:
    recipe = {"model": model, "stages": [{"method": "rtn", "bits": bits, "group_size": group}], "output": {"path": out, "format": fmt}}
    run_recipe(parse_recipe(recipe))
    return out


def cli_json(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_pareto_front_by_hand():
    points = [(1.0, 5.0), (2.0, 3.0), (2.5, 3.0), (3.0, 4.0), (4.0, 1.0), (4.0, 1.0)]
    # (2.5, 3) is dominated by (2, 3); (3, 4) by (2, 3); equal points do not dominate each other
    assert pareto_front(points) == [0, 1, 4, 5]


def test_unpermute_inverts_the_exporters_permutation():
    from compress.export.gguf import permute_rope

    w = torch.randn(64, 48)
    for heads in (1, 2, 4):
        assert torch.equal(unpermute_rope(permute_rope(w, heads), heads), w)


def test_nominal_bits_of_a_recorded_grid():
    assert nominal_bits({"stages": [{"method": "rtn", "bits": 4, "group_size": 128, "symmetric": True}]}) == 4 + 16 / 128
    assert nominal_bits({"stages": [{"method": "rtn", "bits": 3, "group_size": 64, "symmetric": False}]}) == 3 + 19 / 64
    assert nominal_bits({"stages": [{"method": "wanda", "sparsity": 0.5}]}) is None
    # float grids: an E4M3 scale per 16 (NVFP4), an E8M0 one per 32 (MXFP4), float32 FP8 block scales
    assert nominal_bits({"stages": [{"method": "rtn", "grid": "nvfp4", "bits": 4, "group_size": 16}]}) == 4.5
    assert nominal_bits({"stages": [{"method": "rtn", "grid": "mxfp4", "bits": 4, "group_size": 32}]}) == 4.25
    assert nominal_bits({"stages": [{"method": "rtn", "grid": "fp8", "bits": 8, "group_size": -1}]}) == 8


def test_report_rows_equal_compress_eval_ppl(tiny_llama, tmp_path):
    """Every checkpoint row is exactly what `compress eval ppl OUT --reference BASELINE` prints."""
    fake = quantize(tiny_llama, tmp_path / "fake-w4", "fake")
    packed = quantize(tiny_llama, tmp_path / "ct-w3", bits=3)
    args = ["--text", str(EVAL_TEXT), "--ctx", "64", "--max-tokens", "600"]
    report = cli_json("report", str(fake), str(packed), "--baseline", str(tiny_llama), "-o", str(tmp_path / "rep"), *args)
    for row in report["outputs"]:
        alone = cli_json("eval", "ppl", row["path"], "--reference", str(tiny_llama), *args)
        assert (row["perplexity"], row["kld"], row["kld_p99"], row["tokens_scored"], row["acceptance"], row["acceptance_t1"]) == (
            alone["perplexity"], alone["kld"], alone["kld_p99"], alone["tokens_scored"], alone["acceptance"], alone["acceptance_t1"],
        )
        assert 0 < row["acceptance"] <= 1
    fake_row, packed_row = report["outputs"]
    assert fake_row["evaluator"] == "transformers" and fake_row["bits_source"] == "nominal" and fake_row["bits_per_weight"] == 4.5
    assert packed_row["evaluator"].startswith("packed") and packed_row["bits_source"] == "stored"
    assert 3.0 < packed_row["bits_per_weight"] < 4.5  # 3-bit codes (10 per int32) + scale per 32 on disk
    assert report["baseline"]["kld"] == 0.0 and report["baseline"]["perplexity"] == pytest.approx(fake_row["perplexity"], rel=0.5)
    assert json.loads((tmp_path / "rep" / "report.json").read_text()) == report


def test_report_refuses_bad_outputs(tiny_llama, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    msg = one_line_error(evaluate_outputs, [text], tiny_llama, Protocol(EVAL_TEXT))
    assert "not GGUF" in msg
    result = runner.invoke(app, ["report", str(tmp_path / "missing"), "--baseline", str(tiny_llama), "--text", str(EVAL_TEXT)])
    assert result.exit_code == 2 and "does not exist" in result.output


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows, self.images, self.stack = 0, [], []

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)
        if tag == "tr" and "tbody" in self.stack:
            self.rows += 1
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop() != tag:
            pass


def test_rendered_report_is_self_contained(tmp_path):
    from PIL import Image

    def row(name, size, kld, bits):
        return {"name": name, "path": name, "kind": "checkpoint", "evaluator": "transformers", "perplexity": 10 + kld,
                "kld": kld, "kld_p99": kld * 3, "tokens_scored": 99, "size_bytes": size, "bits_per_weight": bits,
                "bits_source": "stored", "sparsity": None, "description": f"<{name}>", "extra": {}}

    report = {
        "protocol": {"baseline": "b", "text": "t.txt", "tokens": 100, "ctx": 64, "stride": 64},
        "baseline": {**row("baseline", 4_000_000, 0.0, 32.0), "kind": "baseline"},
        "outputs": [row("a", 1_000_000, 0.1, 4.1), row("b", 2_000_000, 0.01, 8.1), row("c", 2_500_000, 0.2, 9.0)],
    }
    files = write_report(report, tmp_path, XAxis.BPW, YAxis.KLD)
    page = _Page()
    page.feed(files["html"].read_text())
    assert page.rows == 4 and len(page.images) == 1
    src = page.images[0]
    assert src.startswith("data:image/png;base64,")  # embedded: nothing to fetch
    image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
    image.load()
    assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 200
    assert files["png"].read_bytes() == base64.b64decode(src.split(",", 1)[1])
    html = files["html"].read_text()
    assert "&lt;a&gt;" in html and "<a>" not in html  # descriptions escaped
    md = files["md"].read_text()
    assert re.search(r"Pareto front .*: a, b\.", md)  # c (2.5 MB, 9 bits, worse KLD) is dominated by b
    assert json.loads(files["json"].read_text()) == report


# -- GGUF --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """The reference model exported to Q4_0, and the same weights as safetensors dequantized by transformers'
    own GGUF loader (an independent consumer): the safetensors of the same quantization."""
    from transformers import AutoModelForCausalLM

    from compress.checkpoints.loading import load_model
    from compress.export.gguf import ExportConfig, export_gguf
    from compress.formats.gguf.plan import Target
    from compress.checkpoints.output import copy_side_files

    root = tmp_path_factory.mktemp("gguf")
    path = root / "ref-q4_0.gguf"
    export_gguf(ExportConfig(REFERENCE_MODEL, path, Target.q4_0))
    theirs = AutoModelForCausalLM.from_pretrained(root, gguf_file=path.name, dtype=torch.float32)
    model = load_model(REFERENCE_MODEL, torch.device("cpu"))
    model.load_state_dict(theirs.state_dict())
    dense = root / "ref-q4_0-safetensors"
    model.save_pretrained(dense)
    copy_side_files(REFERENCE_MODEL, dense)
    return path, dense


PROTOCOL = Protocol(EVAL_TEXT, ctx=256, max_tokens=2048)


def test_gguf_dequantized_equals_the_same_weights_as_safetensors(gguf_pair):
    path, dense = gguf_pair
    report = evaluate_outputs([path, dense], REFERENCE_MODEL, PROTOCOL, GGUFBackend.DEQUANTIZE)
    gguf_row, dense_row = report.rows
    assert gguf_row.evaluator == "gguf-py dequantized" and dense_row.evaluator == "transformers"
    assert gguf_row.kld == pytest.approx(dense_row.kld, rel=1e-4)
    assert gguf_row.perplexity == pytest.approx(dense_row.perplexity, rel=1e-5)
    assert gguf_row.bits_per_weight == 4.5  # Q4_0: 32 four-bit codes + one fp16 scale
    assert gguf_row.size_bytes == path.stat().st_size


def test_gguf_through_llama_cpp_lands_at_the_safetensors_kld(gguf_pair, llama_cpp_runs):
    """llama.cpp (its own kernels, int8 activations in the dot products) agrees within noise."""
    path, dense = gguf_pair
    report = evaluate_outputs([path, dense], REFERENCE_MODEL, PROTOCOL, GGUFBackend.AUTO)
    cpp, hf = report.rows
    assert cpp.evaluator == "llama.cpp" and cpp.tokens_scored == hf.tokens_scored
    assert cpp.kld == pytest.approx(hf.kld, rel=0.05)
    assert cpp.perplexity == pytest.approx(hf.perplexity, rel=0.01)
