"""The reference model's quality orderings, on a real pretrained model: SmolLM2-135M-Instruct's first 6 blocks
(width 576, vocabulary 49152), calibrated on Shakespeare, KLD from the unquantized (truncated) model on
held-out text. A truncated model's outputs are not good text, but each method's damage to the function it
computes is measured the same way for all, which is what the orderings compare."""

from __future__ import annotations

import pytest

from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, EVAL_TEXT

CALIBRATION = {"path": CALIB_TEXT, "samples": 32, "seq_len": 256}
EVALUATION = {"text": EVAL_TEXT, "ctx": 256, "max_tokens": 2048}
_KLD: dict[tuple, float] = {}  # each run once, shared by the tests of this module


@pytest.fixture(scope="module")
def kld(smollm2_6, tmp_path_factory):
    def run(method: str, **settings) -> float:
        key = (method, *sorted(settings.items()))
        if key not in _KLD:
            data = {
                "model": smollm2_6, "stages": [{"method": method, **settings}], "evaluation": EVALUATION,
                "output": {"path": tmp_path_factory.mktemp("smollm2-q") / "out", "format": "fake"},
            }
            if method != "rtn" and method != "magnitude":
                data["calibration"] = CALIBRATION
            _KLD[key] = run_recipe(parse_recipe(data)).evaluation.kld
        return _KLD[key]

    return run


def test_gptq_at_most_0_6x_rtn_at_w3_g64(kld):
    rtn, gptq = kld("rtn", bits=3, group_size=64), kld("gptq", bits=3, group_size=64)
    assert gptq <= 0.6 * rtn, f"GPTQ KLD {gptq:.5f} vs RTN {rtn:.5f}"


def test_awq_below_rtn_at_w4_g64(kld):
    rtn = kld("rtn", bits=4, group_size=64)
    awq = kld("awq", bits=4, group_size=64, n_grid=10, clip_grid=10)  # half the default grids: half the time
    assert awq < rtn, f"AWQ KLD {awq:.5f} vs RTN {rtn:.5f}"


def test_sparsegpt_at_most_half_of_magnitude_at_50_percent(kld):
    magnitude, sparsegpt = kld("magnitude", sparsity=0.5), kld("sparsegpt", sparsity=0.5)
    assert sparsegpt <= 0.5 * magnitude, f"SparseGPT KLD {sparsegpt:.5f} vs magnitude {magnitude:.5f}"


def test_gptq_in_the_k_quant_grid_below_importance_weighted_rounding(smollm2_6, tmp_path):
    """GGUF Q4_K (576 columns: most tensors fall back to Q5_0, as llama.cpp's): GPTQ solved in each tensor's
    grid against ggml's importance-weighted rounding from an imatrix of the same calibration windows (which
    writes llama-quantize --imatrix's bytes), both scored by dequantizing."""
    from compress.checkpoints.calibration import CalibrationSpec
    from compress.engine.methods.gguf import GGUFGPTQMethodConfig
    from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs
    from compress.export.calibrated import export_calibrated
    from compress.export.gguf import ExportConfig, GGUFMethod, export_gguf
    from compress.export.imatrix import ImatrixConfig, run_imatrix
    from compress.formats.gguf.plan import Target

    calibration = CalibrationSpec(**CALIBRATION)
    imatrix = tmp_path / "imatrix.gguf"
    run_imatrix(ImatrixConfig(smollm2_6, CALIB_TEXT, imatrix, calibration.samples, calibration.seq_len))
    weighted, solved = tmp_path / "imatrix-q4_k.gguf", tmp_path / "gptq-q4_k.gguf"
    export_gguf(ExportConfig(smollm2_6, weighted, Target.q4_k, imatrix=imatrix))
    # the output layer (49152 x 576, tied) is left to plain rounding in both files: the blocks are compared
    export_calibrated(ExportConfig(smollm2_6, solved, Target.q4_k), GGUFMethod.gptq, calibration, gptq=GGUFGPTQMethodConfig(output_layer=False))
    protocol = Protocol(EVAL_TEXT, ctx=EVALUATION["ctx"], max_tokens=EVALUATION["max_tokens"])
    rows = evaluate_outputs([weighted, solved], smollm2_6, protocol, GGUFBackend.DEQUANTIZE).rows
    assert rows[1].kld < rows[0].kld, f"GPTQ q4_k KLD {rows[1].kld:.5f} vs imatrix {rows[0].kld:.5f}"
