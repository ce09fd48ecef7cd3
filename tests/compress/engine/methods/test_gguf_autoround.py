"""AutoRound in the GGML block grids (`compress.engine.methods.gguf_autoround`) through ``compress export --method
autoround``, judged by the written files: no steps on ggml's plain fit write ggml's own bytes, learned rounding
changes exactly the decoder-block matrices and brings the file closer to the float model for transformers' GGUF
loader and llama.cpp, the types without an affine grid are refused before any calibration, and from GPTQ's start
(``init=gptq``) no steps write GGUF GPTQ's file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("gguf")

from compress.cli import app  # noqa: E402
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL, truncate_checkpoint  # noqa: E402

CALIB = ["--calib", CALIB_TEXT, "--samples", "8", "--seq-len", "128"]


def export(model, out, gguf_type, *args):
    result = CliRunner().invoke(app, ["export", str(model), "-o", str(out), "--type", gguf_type, *map(str, args)],
                                catch_exceptions=False)
    return result


def tensors(path) -> dict[str, tuple[str, np.ndarray]]:
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in GGUFReader(str(path)).tensors}


def test_no_steps_on_the_plain_fit_write_ggml_rounding(tmp_path):
    """Q4_K's nearest codes on its own fit are ggml's encoding of these weights: the file equals the plain export,
    tensor by tensor (Q6_K and Q3_K differ in a rare code at a rounding boundary: ggml divides by its scale, the grid
    by the decoder's step; 1 block of 768 in two of the reference model's matrices)."""
    model = truncate_checkpoint(REFERENCE_MODEL, tmp_path / "one-block", blocks=1)
    assert export(model, tmp_path / "rtn.gguf", "q4_k").exit_code == 0
    result = export(model, tmp_path / "ar.gguf", "q4_k", "--method", "autoround", *CALIB, "-O", "iters=0", "-O", "weighted_fit=false")
    assert result.exit_code == 0, result.output
    plain, learned = tensors(tmp_path / "rtn.gguf"), tensors(tmp_path / "ar.gguf")
    assert plain.keys() == learned.keys()
    assert plain["blk.0.ffn_down.weight"][0] == "Q4_K"
    for name in plain:
        assert plain[name][0] == learned[name][0] and np.array_equal(plain[name][1], learned[name][1]), name


@pytest.fixture(scope="module")
def q3_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-autoround")
    rtn, learned = root / "rtn.gguf", root / "autoround.gguf"
    assert export(REFERENCE_MODEL, rtn, "q3_k_m").exit_code == 0
    result = export(REFERENCE_MODEL, learned, "q3_k_m", "--method", "autoround", *CALIB, "-O", "iters=20", "-O", "batch_size=4")
    assert result.exit_code == 0, result.output
    return rtn, learned


def _ids():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(REFERENCE_MODEL / "tokenizer.json")).encode(EVAL_TEXT.read_text(encoding="utf-8")).ids[:4096]


def test_learned_rounding_changes_the_block_matrices_and_lowers_the_kld(q3_files):
    """Measured: KLD 0.0207 against ggml's rounding's 0.0235 (the weighted fit with no steps: 0.0221)."""
    from transformers import AutoModelForCausalLM

    from compress.eval.perplexity import evaluate
    from gguf_reference import transformers_model

    rtn, learned = q3_files
    a, b = tensors(rtn), tensors(learned)
    assert a.keys() == b.keys() and all(a[n][0] == b[n][0] for n in a)  # the same plan
    changed = {n for n in a if not np.array_equal(a[n][1], b[n][1])}
    matrices = {n for n in a if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n}
    assert changed == matrices  # the output layer and the embeddings: ggml's rounding
    reference = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float32).eval()
    ids = torch.tensor(_ids())
    plain, ours = (evaluate(transformers_model(p), ids, reference=reference, ctx=512).kld for p in (rtn, learned))
    assert ours < 0.93 * plain, (ours, plain)


def test_llama_cpp_runs_the_learned_file(q3_files, llama_cpp_runs):
    from compress.eval.perplexity import evaluate
    from gguf_reference import llamacpp_perplexity, transformers_model

    _, learned = q3_files
    ids = _ids()
    theirs = llamacpp_perplexity(learned, ids, ctx=512)
    ours = evaluate(transformers_model(learned), torch.tensor(ids), ctx=512).perplexity
    assert abs(theirs / ours - 1) < 0.005


def test_a_codebook_type_is_refused_before_calibrating(tmp_path):
    out = tmp_path / "m.gguf"
    result = export(REFERENCE_MODEL, out, "iq4_xs", "--method", "autoround", *CALIB)
    assert result.exit_code == 2
    message = result.stderr.strip()
    assert "\n" not in message and "IQ4_XS" in message and "--method gptq or imatrix" in message
    assert not out.exists()


def test_gptq_start_without_steps_writes_gptqs_file(tmp_path):
    """``-O init=gptq`` with no steps is GGUF GPTQ on the Hessians of one pass per block (``true_sequential=false``),
    the output layer left to ggml's rounding: the two files are equal tensor by tensor (Q4_K and Q6_K in q4_k_m).
    A few steps change the decoder-block matrices and nothing else."""
    model = truncate_checkpoint(REFERENCE_MODEL, tmp_path / "one-block", blocks=1)
    gptq = export(model, tmp_path / "gptq.gguf", "q4_k_m", "--method", "gptq", *CALIB, "-O", "true_sequential=false",
                  "-O", "output_layer=false", "-O", "refit_scales=false")
    start = export(model, tmp_path / "start.gguf", "q4_k_m", "--method", "autoround", *CALIB, "-O", "init=gptq",
                   "-O", "iters=0")
    steps = export(model, tmp_path / "steps.gguf", "q4_k_m", "--method", "autoround", *CALIB, "-O", "init=gptq",
                   "-O", "iters=20", "-O", "batch_size=4")
    assert gptq.exit_code == 0 and start.exit_code == 0 and steps.exit_code == 0, (start.output, steps.output)
    want, got, learned = (tensors(tmp_path / f"{n}.gguf") for n in ("gptq", "start", "steps"))
    assert want.keys() == got.keys() == learned.keys()
    assert {want[n][0] for n in want if n.startswith("blk.") and "norm" not in n} == {"Q4_K", "Q6_K"}
    assert [n for n in want if not (want[n][0] == got[n][0] and np.array_equal(want[n][1], got[n][1]))] == []
    changed = {n for n in want if not np.array_equal(want[n][1], learned[n][1])}
    assert changed == {n for n in want if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n}


def test_a_bad_start_is_one_line(tmp_path):
    out = tmp_path / "m.gguf"
    result = export(REFERENCE_MODEL, out, "q4_k_m", "--method", "autoround", *CALIB, "-O", "init=awq")
    assert result.exit_code == 2
    message = result.stderr.strip()
    assert "\n" not in message and "init" in message and "'rtn' or 'gptq'" in message
    assert not out.exists()
