"""The architecture matrix: every method on every architecture family, through the recipe runner.

Each cell compresses a tiny random checkpoint saved by transformers (tests/architectures.py) with one method
(compressed-tensors output), then checks, from the output files alone, that every linear layer of every block,
every MoE expert's projections included, was compressed (packed codes, or dense weights on the method's grid /
pruned, compared with the input), that routers stayed dense, and that transformers (with compressed-tensors for
packed layers) loads the output with finite logits, equal to our own loader's. A cell a method cannot serve is
the one-line error that says why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import CompressedTensorsConfig

from architectures import ARCHITECTURES, MOE, save_architecture
from compress.checkpoints.loading import load_model
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, checkpoint_tensors
from references import one_line_error

METHODS = {
    "rtn": {"method": "rtn", "bits": 4, "group_size": 32},
    "gptq": {"method": "gptq", "bits": 4, "group_size": 32},
    "awq": {"method": "awq", "bits": 4, "group_size": 32, "n_grid": 4, "clip_grid": 4},
    "smoothquant": {"method": "smoothquant"},
    "sparsegpt": {"method": "sparsegpt", "sparsity": 0.5},
}
# Cells a method cannot serve, and the words their one-line error must contain.
ERRORS = {
    (arch, "smoothquant"): "int8 W8A8 (int-quantized), which transformers' compressed-tensors loader cannot read"
    for arch in MOE
}
# transformers 5 cannot load packed Falcon layers as they are (FalconPreTrainedModel._init_weights reads the weight
# of every FalconLinear, which a packed one does not have): Falcon's are dequantized at load instead.
LOAD_OPTIONS = {"falcon": {"quantization_config": CompressedTensorsConfig(dequantize=True)}}
IN_BLOCK = re.compile(r"\.(layers|h)\.\d+\.")
ROUTER = re.compile(r"(\.gate|shared_expert_gate)\.weight$")  # MoE routers: [experts, hidden], stay dense


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread does the work; a second only spins (half the CPU time of this file)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(CALIB_TEXT.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    """One saved checkpoint per architecture, built on first use."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = save_architecture(arch, tmp_path_factory.mktemp(arch) / arch, tiny_tokenizer)
        return built[arch]

    return get


def _block_linears(source: dict[str, torch.Tensor]) -> set[str]:
    """Every linear layer of the blocks as the input checkpoint stores it (on-disk names), routers aside."""
    return {k.removesuffix(".weight") for k, t in source.items()
            if k.endswith(".weight") and t.dim() == 2 and IN_BLOCK.search(k) and not ROUTER.search(k)}


def _on_grid(weight: torch.Tensor, levels: int, group: int) -> bool:
    """At most ``levels`` distinct values in every group of ``group`` consecutive inputs (either orientation:
    GPT-2's Conv1D stores [in, out])."""
    def fits(w):
        return w.shape[1] % group == 0 and all(len(g.unique()) <= levels for g in w.reshape(-1, group))
    return fits(weight) or fits(weight.t())


def _compressed(method: str, out: dict[str, torch.Tensor], source: dict[str, torch.Tensor], record: dict) -> set[str]:
    """The block layers the output shows compressed: packed codes, or dense weights changed onto the method's
    grid (4-bit groups of 32: at most 16 values each), recorded for int8 activations, or half zeros."""
    found = {k.removesuffix(".weight_packed") for k in out if k.endswith(".weight_packed")}
    found |= {k.removesuffix(".weight") for k, t in out.items() if k.endswith(".weight") and t.dtype == torch.int8}
    activation_layers = set()
    for stage in record.get("stages", []):
        activation_layers |= set(stage.get("activation_layers", {}))
    for name in _block_linears(source) - found:
        weight = out.get(f"{name}.weight")
        if weight is None or torch.equal(weight, source[f"{name}.weight"]):
            continue
        if method == "sparsegpt" and (weight == 0).float().mean() >= 0.5:
            found.add(name)
        elif method == "smoothquant" and name in activation_layers:
            found.add(name)
        elif method in ("rtn", "gptq", "awq") and _on_grid(weight.float(), 16, 32):
            found.add(name)
    return found


def _logits(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_method_on_architecture(arch, method, checkpoints, calibration, tmp_path, tiny_tokenizer):
    model = checkpoints(arch)
    out = tmp_path / "out"
    recipe = parse_recipe({
        "model": str(model),
        "calibration": {"path": str(calibration), "samples": 4, "seq_len": 32},
        "stages": [METHODS[method]],
        "output": {"path": str(out), "format": "compressed-tensors"},
    })
    if (arch, method) in ERRORS:
        assert ERRORS[arch, method] in one_line_error(run_recipe, recipe)
        assert not out.exists()
        return
    run_recipe(recipe)
    source, written = checkpoint_tensors(model), checkpoint_tensors(out)
    config = json.loads((out / "config.json").read_text())
    expected = _block_linears(source)
    assert _compressed(method, written, source, config["compression"]) == expected
    assert expected and all(f"{name}.weight" in source for name in expected)  # on-disk names kept (experts per expert)
    assert {k for k in written if not IN_BLOCK.search(k)} <= set(source)  # e.g. GPT-NeoX's output layer stays embed_out
    for router in (k for k in source if ROUTER.search(k)):  # dense; only AWQ/SmoothQuant fold their norm's scales in
        assert written[router].dtype == source[router].dtype
        assert method in ("awq", "smoothquant") or torch.equal(written[router], source[router])

    from transformers import AutoModelForCausalLM

    options = LOAD_OPTIONS.get(arch, {}) if "quantization_config" in config else {}
    theirs = _logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **options).eval(), len(tiny_tokenizer))
    assert torch.isfinite(theirs).all()
    if "quantization_config" in config and method != "smoothquant":  # weight-only packed: both loaders agree
        ours = _logits(load_model(out, torch.device("cpu")), len(tiny_tokenizer))
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_moe_calibration_reports_tokens_per_expert(checkpoints, calibration, tmp_path):
    """Every calibration token reaches every expert's statistics (4 × 32 = 128), the router's real choices are
    counted (each token goes to its top 2 of 4 experts: 256 per layer), and the option turns it off."""
    counts = {}
    for all_experts in (True, False):
        out = tmp_path / f"all-{all_experts}"
        run_recipe(parse_recipe({
            "model": str(checkpoints("qwen3_moe")),
            "calibration": {"path": str(calibration), "samples": 4, "seq_len": 32, "all_experts": all_experts},
            "stages": [{"method": "gptq", "bits": 4, "group_size": 32}],
            "output": {"path": str(out)},
        }))
        layers = json.loads((out / "compression_report.json").read_text())["layers"]
        counts[all_experts] = {r["name"]: r["info"] for r in layers if ".experts." in r["name"]}
    every = counts[True]
    assert len(every) == 2 * 4 * 3  # blocks × experts × projections
    assert {info["calibration_tokens"] for info in every.values()} == {128}
    for block in range(2):
        routed = [every[f"model.layers.{block}.mlp.experts.{e}.gate_proj"]["routed_tokens"] for e in range(4)]
        assert sum(routed) == 128 * 2
    routed_only = counts[False]
    assert all(info["calibration_tokens"] == info["routed_tokens"] for name, info in routed_only.items()
               if name.endswith(("gate_proj", "up_proj")))


@pytest.mark.parametrize("stage, words", [
    ({"method": "rtn", "exclude": ["experts"]}, "left dense beside packed layers"),
    ({"method": "rtn", "symmetric": False}, "would be stored asymmetric"),
])
def test_moe_outputs_transformers_cannot_load_are_refused_before_work(stage, words, checkpoints, tmp_path):
    recipe = parse_recipe({"model": str(checkpoints("mixtral")), "stages": [{**stage, "bits": 4, "group_size": 32}],
                           "output": {"path": str(tmp_path / "out")}})
    assert words in one_line_error(run_recipe, recipe)
    assert not (tmp_path / "out").exists()


def test_moe_w8a8_as_fake_quantized_output_loads(checkpoints, calibration, tmp_path, tiny_tokenizer):
    """The way out the SmoothQuant error names: dense (fake-quantized) experts, smoothed and rounded to int8."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    run_recipe(parse_recipe({"model": str(checkpoints("mixtral")), "calibration": {"path": str(calibration), "samples": 4, "seq_len": 32},
                             "stages": [{"method": "smoothquant"}], "output": {"path": str(out), "format": "fake"}}))
    source, written = checkpoint_tensors(checkpoints("mixtral")), checkpoint_tensors(out)
    assert all(not torch.equal(written[f"{name}.weight"], source[f"{name}.weight"]) for name in _block_linears(source))
    layers = json.loads((out / "config.json").read_text())["compression"]["stages"][0]["activation_layers"]
    assert sum(".experts." in name for name in layers) == 2 * 4 * 3  # every expert's inputs quantized too
    assert torch.isfinite(_logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), len(tiny_tokenizer))).all()
