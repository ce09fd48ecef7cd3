"""A quality ordering on a real pretrained model that the reference model cannot show: SmolLM2-135M-Instruct's
first 2 blocks (width 576, vocabulary 49152), calibrated on Shakespeare, KLD from the unquantized (truncated)
model on held-out text. A truncated model's outputs are not good text, but each method's damage to the function
it computes is measured the same way for both, which is what the ordering compares.

The orderings the reference model shows as well (GPTQ and AWQ against RTN, SparseGPT against magnitude) are
checked on it (tests/eval/test_gptq_quality.py, test_awq_quality.py, test_pruning_quality.py); on SmolLM2 they
are bench/real_model.py's ``--rows quant,pruning``, which ends with whether each holds."""

from __future__ import annotations

from conftest import CALIB_TEXT, EVAL_TEXT


def test_gptq_in_the_k_quant_grid_below_importance_weighted_rounding(smollm2_2, tmp_path):
    """GGUF Q4_K (576 columns: most tensors fall back to Q5_0, as llama.cpp's): GPTQ solved in each tensor's
    grid against ggml's importance-weighted rounding from an imatrix of the same calibration windows (which
    writes llama-quantize --imatrix's bytes), both scored by dequantizing. Measured: GPTQ / imatrix KLD 0.92 here
    (16 x 256 windows, 1024 tokens), 0.87 on 6 blocks (32 x 256, 2048 tokens)."""
    from compress.checkpoints.calibration import CalibrationSpec
    from compress.engine.methods.gguf import GGUFGPTQMethodConfig
    from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs
    from compress.export.calibrated import export_calibrated
    from compress.export.gguf import ExportConfig, GGUFMethod, export_gguf
    from compress.export.imatrix import ImatrixConfig, run_imatrix
    from compress.formats.gguf.plan import Target

    calibration = CalibrationSpec(path=CALIB_TEXT, samples=16, seq_len=256)
    imatrix = tmp_path / "imatrix.gguf"
    run_imatrix(ImatrixConfig(smollm2_2, CALIB_TEXT, imatrix, calibration.samples, calibration.seq_len))
    weighted, solved = tmp_path / "imatrix-q4_k.gguf", tmp_path / "gptq-q4_k.gguf"
    export_gguf(ExportConfig(smollm2_2, weighted, Target.q4_k, imatrix=imatrix))
    # the output layer (49152 x 576, tied) is left to plain rounding in both files: the blocks are compared
    export_calibrated(ExportConfig(smollm2_2, solved, Target.q4_k), GGUFMethod.gptq, calibration, gptq=GGUFGPTQMethodConfig(output_layer=False))
    protocol = Protocol(EVAL_TEXT, ctx=256, max_tokens=1024)
    rows = evaluate_outputs([weighted, solved], smollm2_2, protocol, GGUFBackend.DEQUANTIZE).rows
    assert rows[1].kld < rows[0].kld, f"GPTQ q4_k KLD {rows[1].kld:.5f} vs imatrix {rows[0].kld:.5f}"
