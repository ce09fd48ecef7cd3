"""SparseGPT and Wanda against magnitude pruning on the reference model: KLD from the dense model on held-out text."""

from __future__ import annotations

import pytest

from compress.recipe import parse_recipe
from compress.runner import run_recipe
from conftest import CALIB_TEXT, EVAL_TEXT, REFERENCE_MODEL

TARGETS = {"50%": {"sparsity": 0.5}, "2:4": {"pattern": "2:4"}}
_KLD: dict[tuple[str, str], float] = {}  # each run once, shared by the tests of this module


@pytest.fixture(scope="module")
def pruned_kld(tmp_path_factory):
    def kld(method: str, target: str) -> float:
        if (method, target) not in _KLD:
            data = {
                "model": REFERENCE_MODEL,
                "stages": [{"method": method, **TARGETS[target]}],
                "output": {"path": tmp_path_factory.mktemp("pruned") / f"{method}-{target.replace(':', 'of')}"},
                "evaluation": {"text": EVAL_TEXT, "ctx": 512},
            }
            if method != "magnitude":
                data["calibration"] = {"path": CALIB_TEXT, "samples": 64, "seq_len": 512}
            _KLD[method, target] = run_recipe(parse_recipe(data)).evaluation.kld
        return _KLD[method, target]

    return kld


@pytest.mark.parametrize("target", TARGETS)
def test_sparsegpt_halves_magnitude_kld(target, pruned_kld):
    sparsegpt, mag = pruned_kld("sparsegpt", target), pruned_kld("magnitude", target)
    assert sparsegpt <= 0.5 * mag, f"{target}: SparseGPT KLD {sparsegpt:.5f} vs magnitude {mag:.5f}"


@pytest.mark.parametrize("target", TARGETS)
def test_wanda_beats_magnitude(target, pruned_kld):
    wanda, mag = pruned_kld("wanda", target), pruned_kld("magnitude", target)
    assert wanda < mag, f"{target}: Wanda KLD {wanda:.5f} vs magnitude {mag:.5f}"
