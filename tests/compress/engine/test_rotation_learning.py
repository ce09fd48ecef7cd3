"""The `rotate` method's learned kind (compress.engine.rotation_learning: SpinQuant's R1 and R2 by Cayley SGD): the
learned checkpoint computes the original's function (transformers' float64 forward of both); the rotations stay
orthogonal; the quantized model's cross entropy, computed here with a textbook round-to-nearest, starts at the
training's first loss and ends below the random-hadamard start's; the CLI takes it; refusals are one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compress.checkpoints.calibration import load_calibration
from compress.checkpoints.loading import load_tokenizer
from compress.errors import CompressError
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, tiny_llama_config

_SMALL = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
CASES = {
    "llama": lambda: tiny_llama_config(**_SMALL),
    "qwen2-bias": lambda: __import__("transformers").Qwen2Config(vocab_size=300, num_hidden_layers=2, **_SMALL),
    "gemma-norm-offset-tied": lambda: __import__("transformers").GemmaConfig(vocab_size=300, num_hidden_layers=2, **_SMALL),
}


def _random_model(tmp_path, config, tokenizer, seed: int = 0):
    """A float64 model with every parameter random, norms included (a unit norm would hide a missing fold)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.3 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _norm_in_float64(offset):
    def forward(self, x):  # transformers' RMSNorms compute in float32 whatever the model's dtype
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        return (offset + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return forward


def _rotate(model, out, samples=4, seq_len=32, **settings):
    recipe = {"model": model, "calibration": {"path": CALIB_TEXT, "samples": samples, "seq_len": seq_len},
              "stages": [{"method": "rotate", **settings}], "output": {"path": out}}
    return run_recipe(parse_recipe(recipe))


@pytest.mark.parametrize("case", CASES)
def test_the_learned_checkpoint_computes_the_same_function(case, tmp_path, tiny_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma import modeling_gemma
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    for norm, offset in ((modeling_llama.LlamaRMSNorm, 0.0), (modeling_qwen2.Qwen2RMSNorm, 0.0), (modeling_gemma.GemmaRMSNorm, 1.0)):
        monkeypatch.setattr(norm, "forward", _norm_in_float64(offset))
    model = _random_model(tmp_path, CASES[case](), tiny_tokenizer)
    learned = _rotate(model, tmp_path / "learned", kind="learned", steps=3, train_bits=3)
    start = _rotate(model, tmp_path / "start", kind="random-hadamard")
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before, after = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float64)(ids).logits for p in (model, learned.output))
    assert (after - before).abs().max() < 1e-9 * before.abs().max()
    from safetensors.torch import load_file

    moved, first = load_file(learned.output / "model.safetensors"), load_file(start.output / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
        assert not torch.allclose(moved[name], first[name], atol=1e-6)  # trained away from random-hadamard's R1, R2
    assert "learned by 3 Cayley SGD steps" in " ".join(learned.notes)


def test_learned_rotations_stay_orthogonal_and_each_block_has_its_r2(tmp_path, tiny_tokenizer):
    from compress.checkpoints.model_io import open_model
    from compress.checkpoints.rotation_layouts import rotation_layout
    from compress.engine.rotation_learning import Training, learn_rotations
    from compress.quantizers.activations import ActivationPreset
    from compress.quantizers.grid import QuantScheme
    from compress.quantizers.hadamard import random_hadamard

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL), tiny_tokenizer)
    windows = load_calibration(CALIB_TEXT, load_tokenizer(model), 4, 32, 0)
    q, r = random_hadamard(48, 0), random_hadamard(12, 1).expand(2, 12, 12).clone()
    training = Training(6, 1.5, 0.5, 4, 2, QuantScheme(3, True, 16), ActivationPreset.INT8_TOKEN.scheme())
    learned = learn_rotations(open_model(Path(model)), rotation_layout("llama"), q, r, {}, windows, training)
    eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
    assert (learned.q.T @ learned.q - eye(48)).abs().max() < 1e-12
    assert (learned.r.transpose(1, 2) @ learned.r - eye(12)).abs().max() < 1e-12
    assert not torch.allclose(learned.q, q) and not torch.allclose(learned.r[0], learned.r[1])
    assert len(learned.losses) == 6


def _rtn(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Textbook symmetric round-to-nearest per output channel: ``s = max|w| / ((2^b − 1) / 2)``, codes ``−2^(b−1) …
    2^(b−1) − 1``."""
    s = w.abs().amax(dim=1, keepdim=True) / ((2 ** bits - 1) / 2)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round(w / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s


def _int4_per_token(module, args):
    """Textbook symmetric int4 per token as compressed-tensors computes it: ``s = max|x| / 7.5``, codes ``−8 … 7``."""
    x = args[0]
    s = x.abs().amax(dim=-1, keepdim=True) / 7.5
    return (torch.clamp(torch.round(x / torch.where(s > 0, s, 1.0)), -8, 7) * s, *args[1:])


def _quantized_loss(path, windows, bits: int | None, inputs: bool) -> float:
    """The mean next-token cross entropy on ``windows`` of ``path`` with every block linear weight on ``bits`` (None:
    float) and, with ``inputs``, every block linear layer's input on int4 per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                if bits is not None:
                    module.weight.copy_(_rtn(module.weight, bits))
                if inputs:
                    module.register_forward_pre_hook(_int4_per_token)
        logits = model(windows).logits
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()))


@pytest.mark.parametrize("bits, inputs", [(3, False), (3, True), (None, True)])
def test_the_quantized_loss_falls_below_the_random_hadamard_start(bits, inputs, outlier_model, tmp_path):
    """The reference model with outlier channels: every step on all 8 windows, W3 per channel, with int4 per-token
    inputs or not, or (SpinQuant's setting before GPTQ) float weights and int4 inputs: the training's first loss is the
    random-hadamard checkpoint's quantized loss as computed here; with W3 the training's last loss and the learned
    checkpoint's are below it (int4 inputs alone: a loss too rough for 8 steps to fall for sure)."""
    settings = dict(samples=8, seq_len=64, seed=3)
    grid = {"train_bits": bits, **({"train_activations": "int4-token"} if inputs else {})}
    learned = _rotate(outlier_model, tmp_path / "learned", kind="learned", steps=8, windows=8, **grid, **settings)
    start = _rotate(outlier_model, tmp_path / "start", kind="random-hadamard", **settings)
    windows = load_calibration(CALIB_TEXT, load_tokenizer(outlier_model), 8, 64, 0)
    note = next(n for n in learned.notes if n.startswith("learned by"))
    first, last = (float(x) for x in re.findall(r"(\d+\.\d+) at the", note))
    before, after = (_quantized_loss(p, windows, bits, inputs) for p in (start.output, learned.output))
    assert abs(first - before) < 2e-4 + 1e-4 * before  # the training's loss is this model's, to float32's sums
    if bits is not None:
        assert after < before - 0.01 and last < first - 0.01, (before, last, after)


def test_the_cli_quantizes_after_a_learned_rotation_on_the_stages_grid(tmp_path, tiny_tokenizer):
    """``--rotate learned``: trained on the quantize stage's input grid (the weights in float, SpinQuant's setting
    before the weights are fitted), or without one on its weight grid; the output's record names it."""
    from typer.testing import CliRunner

    from compress.cli import app

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL), tiny_tokenizer)
    out = tmp_path / "out"
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(out), "--method", "rtn", "--bits", "4", "--group-size", "16",
                                    "-O", "activations=int4-token", "--format", "fake", "--rotate", "learned", "--rotate-online", "r4",
                                    "--calib", str(CALIB_TEXT), "--samples", "4", "--seq-len", "32"])
    assert done.exit_code == 0, done.output
    stage = json.loads((out / "config.json").read_text())["compression"]["history"][0]["stages"][0]
    assert stage["kind"] == "learned" and stage["online"] == ["r4"]
    assert (stage["train_bits"], stage["train_activations"]) == (None, "int4-token")
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(out), "--overwrite", "--method", "rtn", "--bits", "3",
                                    "--group-size", "16", "--rotate", "learned", "--calib", str(CALIB_TEXT), "--samples", "4",
                                    "--seq-len", "32"])
    assert done.exit_code == 0, done.output
    stage = json.loads((out / "config.json").read_text())["compression"]["history"][0]["stages"][0]
    assert (stage["train_bits"], stage["train_group_size"], stage["train_activations"]) == (3, 16, None)


@pytest.mark.parametrize("settings, needle", [
    ({"kind": "hadamard", "steps": 3}, "steps: settings of kind learned: drop them, or use kind learned"),
    ({"kind": "learned", "block": 16}, "a learned rotation mixes every channel: drop block"),
    ({"kind": "learned", "residual": False, "heads": False, "online": ["r4"]}, "learned trains R1 and R2: keep residual or heads"),
    ({"kind": "learned", "train_activations": "int8-tensor"}, "needs a calibrated static scale"),
    ({"kind": "learned", "train_bits": None}, "train_bits null without train_activations quantizes nothing"),
    ({"kind": "learned", "train_group_size": 40}, "group_size 40 does not divide the 48 inputs"),
])
def test_what_learned_cannot_do_is_one_line(settings, needle, tmp_path, tiny_tokenizer):
    model = _random_model(tmp_path, tiny_llama_config(**_SMALL), tiny_tokenizer)
    with pytest.raises(CompressError) as caught:
        _rotate(model, tmp_path / "rotated", **settings)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "rotated").exists()


def test_without_calibration_or_under_a_launcher_learned_is_refused(tmp_path, tiny_tokenizer, monkeypatch):
    from typer.testing import CliRunner

    from compress.cli import app

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL), tiny_tokenizer)
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(tmp_path / "q"), "--method", "rtn", "--group-size", "16",
                                    "--rotate", "learned"])
    assert done.exit_code == 2 and "rotate learned trains on calibration windows: give a calibration set" in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1 and not (tmp_path / "q").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CompressError, match="rewrites the checkpoint in one process: run it without a launcher") as caught:
        _rotate(model, tmp_path / "rotated", kind="learned")
    assert "\n" not in str(caught.value) and not (tmp_path / "rotated").exists()


def _learn_on_rank(rank: int, init: str, model: str, windows: str, out: str) -> None:
    import torch.distributed as dist

    from compress.engine.ranks import Ranks

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ranks = Ranks(rank, 2)
    torch.save(_learn(model, torch.load(windows), ranks), out.format(rank))
    ranks.close()


def _learn(model, windows, ranks=None):
    from compress.checkpoints.model_io import open_model
    from compress.checkpoints.rotation_layouts import rotation_layout
    from compress.engine.rotation_learning import Training, learn_rotations
    from compress.quantizers.activations import ActivationPreset
    from compress.quantizers.grid import QuantScheme
    from compress.quantizers.hadamard import random_hadamard

    q, r = random_hadamard(48, 0), random_hadamard(12, 1).expand(2, 12, 12).clone()
    training = Training(1, 1.5, 0.5, 6, 2, QuantScheme(3, True, 16), ActivationPreset.INT4_TOKEN.scheme())
    extra = {} if ranks is None else {"ranks": ranks}
    learned = learn_rotations(open_model(Path(model)), rotation_layout("llama"), q, r, {}, windows, training, **extra)
    return learned.q, learned.r, learned.losses


def test_two_processes_take_the_steps_of_one(tmp_path, tiny_tokenizer):
    """Each of 2 gloo ranks runs its share of the step's windows and the gradients are summed: both take the same
    step, one process's to 1e-12 (the windows' gradients are summed in another order, a difference that the quantized
    loss's rounding can amplify over later steps)."""
    import torch.multiprocessing as mp

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL), tiny_tokenizer)
    windows = load_calibration(CALIB_TEXT, load_tokenizer(model), 8, 32, 0)
    torch.save(windows, tmp_path / "windows.pt")
    out = str(tmp_path / "rank{}.pt")
    mp.start_processes(_learn_on_rank, args=(f"file://{tmp_path / 'store'}", str(model), str(tmp_path / "windows.pt"), out),
                       nprocs=2, start_method="spawn")
    q, r, losses = _learn(model, windows)
    (q0, r0, losses0), (q1, r1, losses1) = (torch.load(out.format(rank)) for rank in (0, 1))
    assert torch.equal(q0, q1) and torch.equal(r0, r1) and losses0 == losses1  # every rank the same bits
    assert torch.allclose(q0, q, atol=1e-12) and torch.allclose(r0, r, atol=1e-12)
    assert losses0 == pytest.approx(losses, rel=1e-5)


def test_export_refuses_a_learned_rotation_in_one_line(tmp_path, tiny_tokenizer):
    from typer.testing import CliRunner

    from compress.cli import app

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL), tiny_tokenizer)
    done = CliRunner().invoke(app, ["export", str(model), "-o", str(tmp_path / "r.gguf"), "--type", "f16", "--rotate", "learned"])
    assert done.exit_code == 2 and "rotate first with `compress run`" in done.output, done.output
    assert len(done.output.strip().splitlines()) == 1 and not (tmp_path / "r.gguf").exists()


def test_only_a_learned_record_carries_the_training_settings():
    from compress.engine.registry import method_class

    rotate = method_class("rotate")
    assert "steps" not in rotate(rotate.Config(kind="hadamard")).record()
    assert rotate(rotate.Config(kind="learned", steps=5)).record()["steps"] == 5
