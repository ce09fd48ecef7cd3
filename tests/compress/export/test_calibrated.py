"""Calibrated GGUF export (`compress.export.calibrated`): GPTQ in the GGML grids and AWQ scales, judged
by the consumers' view of the written files (transformers' GGUF loader, llama.cpp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from compress.eval.perplexity import evaluate  # noqa: E402
from compress.export.gguf import ExportConfig, GGUFMethod, export_gguf  # noqa: E402
from compress.export.calibrated import export_calibrated  # noqa: E402
from compress.formats.gguf.plan import Target  # noqa: E402
from compress.engine.methods.gguf import GGUFAWQMethodConfig, GGUFGPTQMethodConfig  # noqa: E402
from compress.checkpoints.calibration import CalibrationSpec  # noqa: E402
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL  # noqa: E402
from gguf_reference import transformers_model  # noqa: E402

CALIBRATION = CalibrationSpec(path=CALIB_TEXT, samples=16, seq_len=256)


@pytest.fixture(scope="module")
def q3k_files(tmp_path_factory):
    """The reference model at Q3_K: ggml's rounding and GPTQ-in-GGUF."""
    root = tmp_path_factory.mktemp("calibrated")
    rtn, gptq = root / "rtn.gguf", root / "gptq.gguf"
    export_gguf(ExportConfig(REFERENCE_MODEL, rtn, Target.q3_k))
    result = export_calibrated(ExportConfig(REFERENCE_MODEL, gptq, Target.q3_k), GGUFMethod.gptq, CALIBRATION,
                               gptq=GGUFGPTQMethodConfig(compare_rtn=True))
    return rtn, gptq, result


@pytest.fixture(scope="module")
def scorer():
    """KLD / perplexity of a GGUF file, loaded by transformers, against the reference model; each file scored once
    in the module (q3k_files' are read by several tests, and a written file does not change)."""
    from transformers import AutoModelForCausalLM
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json")).encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:4096]
    reference = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float32).eval()
    scores = {}

    def score(path):
        if path not in scores:
            scores[path] = evaluate(transformers_model(path), torch.tensor(ids), reference=reference, ctx=512)
        return scores[path]

    return score


def tensors(path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader

    return {t.name: np.array(t.data) for t in GGUFReader(str(path)).tensors}


def test_gptq_file_has_the_plan_and_solves_every_linear_layer(q3k_files):
    rtn, gptq, result = q3k_files
    a, b = tensors(rtn), tensors(gptq)
    assert a.keys() == b.keys() and all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a)  # same plan
    changed = {n for n in a if not np.array_equal(a[n], b[n])}
    matrices = {n for n in a if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n}
    assert changed == matrices | {"output.weight"}  # token embeddings and norms as in the plain file
    assert any("below ggml's rounding" in note for note in result.notes)


def test_gptq_file_records_the_digests_of_its_inputs(q3k_files):
    """The record's SHA-256 of the model's files and the calibration text (hashed beside the calibration), by hashlib."""
    import hashlib
    import json

    from gguf import GGUFReader

    from compress.export.gguf import PROVENANCE_KEY

    field = GGUFReader(str(q3k_files[1])).fields[PROVENANCE_KEY]
    record = json.loads(bytes(field.parts[field.data[0]]).decode())
    files = sorted(p for p in REFERENCE_MODEL.iterdir() if p.is_file() and not p.name.startswith("."))
    assert record["inputs"]["model"]["sha256"] == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert record["inputs"]["calibration"]["sha256"] == {CALIB_TEXT.name: hashlib.sha256(CALIB_TEXT.read_bytes()).hexdigest()}
    assert record["method"] == "gptq" and record["calibration"]["samples"] == CALIBRATION.samples


def test_gptq_file_beats_ggml_rounding_for_the_consumer(q3k_files, scorer):
    """GPTQ's error feedback (and the output layer solved on the final hidden states) must show in the
    consumer's next-token distributions, not only in the per-layer objective."""
    rtn, gptq, _ = q3k_files
    plain, solved = scorer(rtn), scorer(gptq)
    assert solved.kld < 0.85 * plain.kld, (solved.kld, plain.kld)
    assert solved.perplexity < plain.perplexity


def test_asymmetric_gptq_file_is_closer_to_the_original_model(tmp_path, scorer):
    """Asymmetric calibration: the blocks start from the file's rounded embeddings and every layer, the output
    layer too, is fitted to the original model's outputs; the embeddings stay ggml's rounding, byte for byte."""
    from compress.engine.methods.gguf import GGUFGPTQMethodConfig

    calibration = CalibrationSpec(path=CALIB_TEXT, samples=32, seq_len=256)  # W* is fitted: 16 x 256 gained 6 %, 32 x 256 21 %
    files = {a: tmp_path / f"asymmetric-{a}.gguf" for a in (False, True)}
    for asymmetric, path in files.items():
        export_calibrated(ExportConfig(REFERENCE_MODEL, path, Target.q2_k), GGUFMethod.gptq, calibration,
                          gptq=GGUFGPTQMethodConfig(asymmetric=asymmetric))
    plain, solved = scorer(files[False]), scorer(files[True])
    assert solved.kld < 0.9 * plain.kld, (solved.kld, plain.kld)
    assert np.array_equal(tensors(files[True])["token_embd.weight"], tensors(files[False])["token_embd.weight"])


def test_llama_cpp_agrees_with_transformers_on_the_gptq_file(q3k_files, scorer, llama_cpp_runs):
    from gguf_reference import llamacpp_perplexity
    from tokenizers import Tokenizer

    _, gptq, _ = q3k_files
    ids = Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json")).encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:4096]
    theirs = llamacpp_perplexity(gptq, ids, ctx=512)
    assert abs(theirs / scorer(gptq).perplexity - 1) < 0.005


def test_awq_file_folds_scales_and_keeps_quality(tmp_path, q3k_files, scorer):
    rtn, _, _ = q3k_files
    out = tmp_path / "awq.gguf"
    export_calibrated(
        ExportConfig(REFERENCE_MODEL, out, Target.q3_k), GGUFMethod.awq, CALIBRATION, awq=GGUFAWQMethodConfig(n_grid=5)
    )
    a, b = tensors(rtn), tensors(out)
    assert not np.array_equal(a["blk.0.attn_norm.weight"], b["blk.0.attn_norm.weight"])  # scales folded
    assert scorer(out).kld < 1.02 * scorer(rtn).kld
    assert sorted(p.name for p in tmp_path.iterdir()) == ["awq.gguf", "awq.gguf.manifest.json"]  # the scratch checkpoint is gone


def test_awq_then_gptq_writes_the_solved_bytes_of_the_scaled_model(tmp_path, q3k_files, scorer):
    rtn, _, _ = q3k_files
    out = tmp_path / "awq-gptq.gguf"
    result = export_calibrated(
        ExportConfig(REFERENCE_MODEL, out, Target.q3_k), GGUFMethod.awq_gptq, CALIBRATION, awq=GGUFAWQMethodConfig(n_grid=5)
    )
    a, b = tensors(rtn), tensors(out)
    assert not np.array_equal(a["blk.0.attn_norm.weight"], b["blk.0.attn_norm.weight"])
    assert not any("below ggml's rounding" in note for note in result.notes)  # compare_rtn is off by default
    assert scorer(out).kld < 0.85 * scorer(rtn).kld


def test_awq_gptq_in_a_type_ggml_fits_only_with_an_importance_matrix(tmp_path):
    """IQ2_XS (llama.cpp's file type): AWQ's search round-trips each layer through ggml's fit, which needs an
    importance matrix; a flat one stands in, as for any plain encoding of such a type. On the reference model's
    first block: each block's fits are the same work."""
    from conftest import truncate_checkpoint

    model = truncate_checkpoint(REFERENCE_MODEL, tmp_path / "one-block", blocks=1)
    out = tmp_path / "awq-gptq.gguf"
    export_calibrated(ExportConfig(model, out, Target.iq2_xs), GGUFMethod.awq_gptq, CALIBRATION, awq=GGUFAWQMethodConfig(n_grid=3))
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == "IQ2_XS" and types["blk.0.attn_v.weight"] == "Q2_K"
    # AWQ alone ends in ggml's plain rounding, which IQ2_XS does not have: refused before any calibration
    from references import one_line_error

    plain = tmp_path / "awq.gguf"
    message = one_line_error(export_calibrated, ExportConfig(model, plain, Target.iq2_xs), GGUFMethod.awq, CALIBRATION)
    assert "needs an importance matrix" in message and "awq-gptq" in message and not plain.exists()


def test_cli_gptq_export(tmp_path):
    from typer.testing import CliRunner

    from compress.cli import app

    out = tmp_path / "m.gguf"
    args = ["export", str(REFERENCE_MODEL), "-o", str(out), "--type", "q4_0", "--method", "gptq",
            "--calib", str(CALIB_TEXT), "--samples", "4", "--seq-len", "128", "--json"]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:4] == b"GGUF" and "gptq" in res.output


def test_gptq_export_in_chunks_of_windows_writes_the_file_of_one_batch(tmp_path, monkeypatch):
    """``window_chunks`` (`compress export`'s policy with calibration text): the windows' forwards in chunks taking
    turns, a window each here, and the tensors of the one-batch export byte for byte."""
    from compress.engine import block_engine, one_pass

    calibration = CalibrationSpec(path=CALIB_TEXT, samples=3, seq_len=64)
    chunks = []
    monkeypatch.setattr(one_pass, "CHUNK_BYTES", 1)  # a window each
    monkeypatch.setattr(block_engine, "solve_while_propagating", lambda block, parts, *a, solve=block_engine.solve_while_propagating, **k: (
        chunks.append(len(parts)), solve(block, parts, *a, **k))[1])
    one, cut = tmp_path / "one.gguf", tmp_path / "chunks.gguf"
    export_calibrated(ExportConfig(REFERENCE_MODEL, one, Target.q4_k_m), GGUFMethod.gptq, calibration)
    assert set(chunks) == {1}
    chunks.clear()
    export_calibrated(ExportConfig(REFERENCE_MODEL, cut, Target.q4_k_m), GGUFMethod.gptq, calibration, window_chunks=True)
    assert set(chunks) == {3}
    a, b = tensors(one), tensors(cut)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name


def test_recipe_export_with_gptq_needs_calibration():
    from compress.run.recipe import parse_recipe
    from references import one_line_error

    base = {"model": str(REFERENCE_MODEL), "stages": [{"method": "rtn"}], "output": {"path": "x", "format": "fake"}}
    msg = one_line_error(parse_recipe, {**base, "export": {"path": "x.gguf", "method": "gptq"}})
    assert "calibration" in msg
    parse_recipe({**base, "calibration": {"path": str(CALIB_TEXT)}, "export": {"path": "x.gguf", "method": "gptq"}})


@pytest.fixture(scope="module")
def iq4_xs_files(tmp_path_factory):
    """The reference model at IQ4_XS (non-uniform codebook): ggml's importance-weighted rounding from an
    imatrix of the calibration windows (llama-quantize --imatrix's bytes), and GPTQ-in-GGUF on the same windows."""
    from compress.export.imatrix import ImatrixConfig, run_imatrix

    root = tmp_path_factory.mktemp("iq4_xs")
    calibration = CalibrationSpec(path=CALIB_TEXT, samples=8, seq_len=256)
    imatrix = root / "imatrix.gguf"
    run_imatrix(ImatrixConfig(REFERENCE_MODEL, CALIB_TEXT, imatrix, calibration.samples, calibration.seq_len))
    weighted, solved = root / "imatrix-iq4_xs.gguf", root / "gptq-iq4_xs.gguf"
    export_gguf(ExportConfig(REFERENCE_MODEL, weighted, Target.iq4_xs, imatrix=imatrix))
    export_calibrated(ExportConfig(REFERENCE_MODEL, solved, Target.iq4_xs), GGUFMethod.gptq, calibration)
    return weighted, solved


def test_gptq_in_the_iq4_xs_codebook_beats_importance_weighted_rounding(iq4_xs_files, scorer):
    """Both files scored by transformers' dequantization against the float model (measured 0.0084 vs 0.0120;
    llama.cpp's own scoring of 64 x 512 calibrated files: 0.0084 vs 0.0127, bench/gguf_quality.py)."""
    weighted, solved = iq4_xs_files
    assert tensors(weighted).keys() == tensors(solved).keys()
    plain, gptq = scorer(weighted), scorer(solved)
    assert gptq.kld < 0.85 * plain.kld, (gptq.kld, plain.kld)


def test_llama_cpp_agrees_with_transformers_on_the_iq4_xs_gptq_file(iq4_xs_files, scorer, llama_cpp_runs):
    from gguf_reference import llamacpp_perplexity
    from tokenizers import Tokenizer

    _, solved = iq4_xs_files
    ids = Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json")).encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:2048]
    ours = evaluate(transformers_model(solved), torch.tensor(ids), ctx=512).perplexity
    assert abs(llamacpp_perplexity(solved, ids, ctx=512) / ours - 1) < 0.005


@pytest.mark.parametrize("kind, gate", [("mixtral", "block_sparse_moe.experts.{}.w1"), ("qwen2_moe", "mlp.experts.{}.gate_proj")])
def test_gptq_solves_every_expert_into_its_place(tmp_path, tiny_tokenizer, kind, gate):
    """MoE experts (Mixtral's named otherwise on disk than in the model): each expert's GPTQ bytes land in its
    own slice of the stacked ``ffn_gate_exps`` (they differ from ggml's rounding, and each slice decodes
    closest to the checkpoint's weight of that expert)."""
    from gguf import GGUFReader, dequantize
    from safetensors.torch import load_file

    from architectures import save_architecture

    model = save_architecture(kind, tmp_path / kind, tiny_tokenizer)
    rtn, gptq = tmp_path / "rtn.gguf", tmp_path / "gptq.gguf"
    export_gguf(ExportConfig(model, rtn, Target.q4_0))
    export_calibrated(ExportConfig(model, gptq, Target.q4_0), GGUFMethod.gptq, CalibrationSpec(path=CALIB_TEXT, samples=8, seq_len=64))
    plain, solved = ({t.name: t for t in GGUFReader(str(f)).tensors} for f in (rtn, gptq))
    state = {k: v.float().numpy() for k, v in load_file(next(model.glob("*.safetensors"))).items()}
    weights = np.stack([state[f"model.layers.1.{gate.format(e)}.weight"] for e in range(4)])
    tensor = solved["blk.1.ffn_gate_exps.weight"]
    decoded = dequantize(tensor.data, tensor.tensor_type).reshape(weights.shape)
    raw_solved, raw_plain = (np.asarray(t["blk.1.ffn_gate_exps.weight"].data).reshape(4, -1) for t in (solved, plain))
    for e in range(4):
        assert not np.array_equal(raw_solved[e], raw_plain[e])
        errors = [np.abs(decoded[e] - weights[other]).mean() for other in range(4)]
        assert int(np.argmin(errors)) == e


def test_tied_embeddings_are_solved_as_the_output_layer(tmp_path):
    """With tied embeddings the one GGUF tensor serves the lookup and the output projection; solving it by
    GPTQ as the output layer (on the quantized model's final hidden states) must lower the consumer's KLD
    against the float model below ggml's rounding of it (SmolLM2 at IQ4_XS: 0.140 -> 0.083, llama.cpp's
    scoring). Here: the reference model made tied (its embeddings as the output layer), Q4_K, scored by
    transformers' GGUF loader against that tied float model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from compress.engine.methods.gguf import GGUFGPTQMethodConfig

    tied = tmp_path / "tied"
    shutil.copytree(REFERENCE_MODEL, tied)
    (weights,) = tied.glob("*.safetensors")
    state = load_file(weights)
    del state["lm_head.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    files = {solve: tmp_path / f"tied-{solve}.gguf" for solve in (True, False)}
    for solve, path in files.items():
        export_calibrated(ExportConfig(tied, path, Target.q4_k), GGUFMethod.gptq, CALIBRATION,
                          gptq=GGUFGPTQMethodConfig(tied_output=solve))
    assert "output.weight" not in tensors(files[True])  # still one tensor, read by both roles
    solved, rounded = tensors(files[True])["token_embd.weight"], tensors(files[False])["token_embd.weight"]
    assert not np.array_equal(solved, rounded)
    ids = Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json")).encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:4096]
    reference = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    klds = {solve: evaluate(transformers_model(path), torch.tensor(ids), reference=reference, ctx=512).kld for solve, path in files.items()}
    assert klds[True] < 0.95 * klds[False], klds  # measured 0.0097 vs 0.0112
