"""SmoothQuant W8A8: smoothing against plain W8A8, on the reference model and with injected outliers."""

from __future__ import annotations

import pytest

from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL

_KLD: dict[tuple[str, bool, str], float] = {}


@pytest.fixture(scope="module")
def w8a8_kld(tmp_path_factory, outlier_model):
    models = {"reference": REFERENCE_MODEL, "outliers": outlier_model}

    def kld(model: str, smooth: bool, activations: str = "token") -> float:
        key = (model, smooth, activations)
        if key not in _KLD:
            data = {
                "model": models[model],
                "stages": [{"method": "smoothquant", "smooth": smooth, "activations": activations}],
                "calibration": {"path": CALIB_TEXT, "samples": 16, "seq_len": 512},
                "output": {"path": tmp_path_factory.mktemp("w8a8") / "out", "format": "fake"},
                "evaluation": {"text": EVAL_TEXT, "ctx": 512, "max_tokens": 8192},
            }
            _KLD[key] = run_recipe(parse_recipe(data)).evaluation.kld
        return _KLD[key]

    return kld


@pytest.mark.parametrize("activations", ["token", "tensor"])
def test_smoothing_never_hurts_on_the_reference_model(w8a8_kld, activations):
    smooth, plain = w8a8_kld("reference", True, activations), w8a8_kld("reference", False, activations)
    assert smooth <= plain, f"{activations}: smoothed KLD {smooth:.5f} vs plain {plain:.5f}"


def test_outliers_break_plain_w8a8_and_smoothing_recovers(w8a8_kld):
    plain, smooth = w8a8_kld("outliers", False), w8a8_kld("outliers", True)
    reference = w8a8_kld("reference", False)
    assert plain > 0.1 and plain > 50 * reference, f"plain W8A8 with outliers: KLD {plain:.5f}"
    assert smooth * 5 <= plain, f"smoothed {smooth:.5f} vs plain {plain:.5f}"
