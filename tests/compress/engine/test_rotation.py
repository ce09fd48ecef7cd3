"""compress.engine.rotation through the `rotate` method: the rotated checkpoint computes the same function (float64
models, logits compared with transformers itself), across the architecture data's cases; refusals are one line."""

from __future__ import annotations

import json

import pytest
import torch

from compress.errors import CompressError
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe
from conftest import CALIB_TEXT, tiny_llama_config


def _random_model(tmp_path, config, seed: int = 0):
    """A float64 model with every parameter random, norms included (a unit norm would hide a missing fold)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").to(torch.float64)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.3 * torch.randn_like(param) if "norm" in name else 0.2 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _rms_norm_in_float64(self, x):
    """transformers' RMSNorms compute in float32 whatever the model's dtype; for a float64 comparison, in x's dtype."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _gemma_norm_in_float64(self, x):
    return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.fixture(autouse=True)
def _float64_norms(monkeypatch):
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen2_moe import modeling_qwen2_moe
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    for norm in (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_qwen3.Qwen3RMSNorm,
                 modeling_mixtral.MixtralRMSNorm, modeling_qwen2_moe.Qwen2MoeRMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm):
        monkeypatch.setattr(norm, "forward", _rms_norm_in_float64)
    from transformers.models.gemma import modeling_gemma

    monkeypatch.setattr(modeling_gemma.GemmaRMSNorm, "forward", _gemma_norm_in_float64)


def _logits(path, ids):
    from transformers import AutoModelForCausalLM

    # eager experts: the grouped matrix product of MoE layers has no float64 kernel
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


def _rotate(model, out, **settings):
    recipe = {"model": model, "stages": [{"method": "rotate", **settings}], "output": {"path": out}}
    return run_recipe(parse_recipe(recipe))


# hidden 48 = 12·4 and head_dim 12: Paley's H_12 inside the Kronecker products; 4 query heads on 2 KV heads
_SMALL = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
CASES = {
    "llama": lambda: tiny_llama_config(**_SMALL),
    "llama-tied": lambda: tiny_llama_config(**_SMALL, tie_word_embeddings=True),
    "qwen2-bias": lambda: __import__("transformers").Qwen2Config(vocab_size=300, num_hidden_layers=2, **_SMALL),
    "qwen3-qk-norms": lambda: __import__("transformers").Qwen3Config(vocab_size=300, num_hidden_layers=2, **_SMALL),
    "gemma-norm-offset-tied": lambda: __import__("transformers").GemmaConfig(vocab_size=300, num_hidden_layers=2, **_SMALL),
    # MoE: the router and every expert read the stream, the experts' down projections write it
    "mixtral": lambda: __import__("transformers").MixtralConfig(vocab_size=300, num_hidden_layers=2, num_local_experts=4,
                                                                num_experts_per_tok=2, **_SMALL),
    "qwen2-moe-shared-expert": lambda: __import__("transformers").Qwen2MoeConfig(
        vocab_size=300, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, **_SMALL),
    "qwen3-moe": lambda: __import__("transformers").Qwen3MoeConfig(
        vocab_size=300, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_SMALL),
}


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
@pytest.mark.parametrize("case", CASES)
def test_the_rotated_checkpoint_computes_the_same_function(case, kind, tmp_path):
    model = _random_model(tmp_path, CASES[case]())
    result = _rotate(model, tmp_path / "rotated", kind=kind)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    before, after = _logits(model, ids), _logits(result.output, ids)
    assert (after - before).abs().max() < 1e-9 * before.abs().max()
    # the weights did change: every matrix that touches the stream is rotated
    from safetensors.torch import load_file

    old, new = load_file(model / "model.safetensors"), load_file(result.output / "model.safetensors")
    assert not torch.allclose(old["model.layers.0.self_attn.q_proj.weight"], new["model.layers.0.self_attn.q_proj.weight"])
    offset = 1.0 if case.startswith("gemma") else 0.0  # Gemma's norms scale by 1 + weight
    assert torch.equal(new["model.norm.weight"] + offset, torch.ones_like(new["model.norm.weight"]))
    config = json.loads((result.output / "config.json").read_text())
    if case in ("llama-tied", "gemma-norm-offset-tied"):  # the final norm's scale is not 1: the output layer is its own tensor
        assert config["tie_word_embeddings"] is False and "lm_head.weight" in new


def test_tied_embeddings_stay_tied_where_the_final_norm_is_one(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL, tie_word_embeddings=True))
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    result = _rotate(model, tmp_path / "rotated", kind="hadamard")
    assert json.loads((result.output / "config.json").read_text()).get("tie_word_embeddings", True) is True
    assert "lm_head.weight" not in load_file(result.output / "model.safetensors")
    ids = torch.arange(1, 25).reshape(1, 24)
    before, after = _logits(model, ids), _logits(result.output, ids)
    assert (after - before).abs().max() < 1e-9 * before.abs().max()


def test_rotation_then_gptq_on_the_rotated_checkpoint(tmp_path, tiny_tokenizer):
    model = _random_model(tmp_path, tiny_llama_config(**_SMALL))
    tiny_tokenizer.save_pretrained(model)
    recipe = {"model": model, "calibration": {"path": CALIB_TEXT, "samples": 4, "seq_len": 32},
              "stages": [{"method": "rotate", "kind": "hadamard"}, {"method": "gptq", "bits": 4, "group_size": 16}],
              "output": {"path": tmp_path / "out"}}
    result = run_recipe(parse_recipe(recipe))
    record = json.loads((result.output / "config.json").read_text())["compression"]
    assert [s["method"] for s in record["stages"]] == ["gptq"]
    assert [s["method"] for h in record["history"] for s in h["stages"]] == ["rotate"]
    assert record["source_model"] == str(model)
    assert result.notes[0].startswith("hadamard rotation of the residual stream (48 wide)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]  # the scratch checkpoint is gone


@pytest.mark.parametrize("config, needle", [
    (lambda: __import__("transformers").GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=300), "subtract the mean"),
    (lambda: tiny_llama_config(hidden_size=92 * 2, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2),
     "no Hadamard matrix of order 184"),
])
def test_what_cannot_be_rotated_is_one_line(config, needle, tmp_path):
    model = _random_model(tmp_path, config())
    with pytest.raises(CompressError) as caught:
        _rotate(model, tmp_path / "rotated")
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "rotated").exists()


@pytest.mark.smollm2
def test_smollm2_rotated_computes_the_same_in_float32(smollm2, tmp_path, monkeypatch):
    """A real model (width 576 = 36·16, head 64, tied embeddings, its Q4_1-dequantized weights), in float32 as users
    run it: logits within 1e-4 relative RMS of the original's."""
    from conftest import truncate_checkpoint

    monkeypatch.undo()  # transformers' own RMSNorm, as any consumer computes it
    model = truncate_checkpoint(smollm2, tmp_path / "smollm2-2", blocks=2)
    result = _rotate(model, tmp_path / "rotated", kind="random-hadamard")
    ids = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        before, after = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)(ids).logits for p in (model, result.output))
    assert ((after - before).pow(2).mean() / before.pow(2).mean()).sqrt() < 1e-4
    assert json.loads((result.output / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_rotated_gguf_runs_in_llama_cpp_as_the_original(tmp_path, llama_cpp_runs):
    """`compress export --rotate`: llama.cpp runs the rotated file unchanged, at the original model's perplexity."""
    from typer.testing import CliRunner

    from compress.cli import app
    from compress.eval.report import GGUFBackend, Protocol, evaluate_outputs
    from conftest import EVAL_TEXT, REFERENCE_MODEL

    files = [tmp_path / "plain.gguf", tmp_path / "rotated.gguf"]
    for path, extra in zip(files, ([], ["--rotate", "hadamard"])):
        done = CliRunner().invoke(app, ["export", str(REFERENCE_MODEL), "-o", str(path), "--type", "f16", *extra])
        assert done.exit_code == 0, done.output
    report = evaluate_outputs(files, REFERENCE_MODEL, Protocol(EVAL_TEXT, ctx=256, max_tokens=2048), GGUFBackend.AUTO)
    plain, rotated = report.rows
    assert plain.evaluator == rotated.evaluator == "llama.cpp"
    assert rotated.perplexity == pytest.approx(plain.perplexity, rel=1e-3) and rotated.kld < 1e-3


def _online_logits_match(model, rotated):
    """Our loader, applying the rotated checkpoint's online transforms, computes the model's float64 logits (to 1e-5:
    the online half runs in float32, its precision). Returns the token ids and the model's logits."""
    from compress.checkpoints.loading import load_model

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    with torch.no_grad():
        after = load_model(rotated, torch.device("cpu"), torch.float64)(ids).logits
    assert (after - before).abs().max() < 1e-5 * before.abs().max()
    return ids, before


# -- R4: each down projection's input rotated online (compress.checkpoints.transforms) ---------------------------------
def _r4_model(tmp_path, kind: str, case: str = "llama"):
    model = _random_model(tmp_path, CASES[case]())
    return model, _rotate(model, tmp_path / "rotated", kind=kind, online=["r4"]).output


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
@pytest.mark.parametrize("case", ["llama", "qwen2-bias", "gemma-norm-offset-tied"])
def test_r4_keeps_the_function_where_the_online_rotation_is_applied(case, kind, tmp_path):
    from compress.checkpoints.architecture import resolve_groups
    from compress.checkpoints.model_io import open_model
    from compress.checkpoints.transforms import ONLINE_ATTR, r4_config

    model, rotated = _r4_model(tmp_path, kind, case)
    ids, before = _online_logits_match(model, rotated)
    # without it (transformers alone), another function: the down projections' weights carry R4's offline half
    assert (_logits(rotated, ids) - before).abs().max() > 1e-3 * before.abs().max()
    # intermediate 96 = 3·32: Sylvester blocks of 32 (compressed-tensors' deterministic hadamard), or one random 96
    config = json.loads((rotated / "config.json").read_text())
    assert config["quantization_config"]["transform_config"] == r4_config(kind, 32 if kind == "hadamard" else None)
    handle = open_model(rotated)  # the engine's skeleton: every down projection hooked, so calibration sees x·M
    assert all(getattr(block.mlp.down_proj, ONLINE_ATTR, None) is not None for block in handle.blocks)
    # AWQ/SmoothQuant: no scale on the down projection's rotated input (the unrotated model has that group)
    scaled = [{n for g in resolve_groups(open_model(path).blocks[0], config["model_type"]) for n in g.group.layers}
              for path in (model, rotated)]
    assert "mlp.down_proj" in scaled[0] and "mlp.down_proj" not in scaled[1]


@pytest.mark.parametrize("heads", [True, False])
@pytest.mark.parametrize("case", ["llama-tied", "gemma-norm-offset-tied"])
def test_without_r1_no_norm_is_folded_and_the_function_is_kept(case, heads, tmp_path):
    """``residual: false``: R2 and R4 alone. The stream, its norms, the embeddings and every reader of the stream are
    stored unchanged (tied embeddings stay tied); the function is kept where R4's online half is applied."""
    from safetensors.torch import load_file

    model = _random_model(tmp_path, CASES[case]())
    rotated = _rotate(model, tmp_path / "rotated", kind="random-hadamard", residual=False, heads=heads, online=["r4"]).output
    _online_logits_match(model, rotated)
    old, new = load_file(model / "model.safetensors"), load_file(rotated / "model.safetensors")
    assert json.loads((rotated / "config.json").read_text())["tie_word_embeddings"] is True and "lm_head.weight" not in new
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight",
                 "model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        assert torch.equal(old[name], new[name]), name
    o_proj, v_proj = "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.v_proj.weight"
    assert torch.equal(old[o_proj], new[o_proj]) is not heads and torch.equal(old[v_proj], new[v_proj]) is not heads
    assert not torch.equal(old["model.layers.1.mlp.down_proj.weight"], new["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_block_rotations_keep_the_function_and_mix_only_within_a_block(kind, tmp_path):
    """``block: 4``: R1, R2 and R4 block-diagonal. The function is kept (R4 applied online), and the embeddings'
    first four columns are the stored ones times one 4 × 4 Hadamard, written out by hand."""
    from safetensors.torch import load_file

    from compress.checkpoints.transforms import R4, r4_config

    model = _random_model(tmp_path, CASES["llama"]())
    rotated = _rotate(model, tmp_path / "rotated", kind=kind, block=4, online=["r4"]).output
    _online_logits_match(model, rotated)
    old, new = load_file(model / "model.safetensors"), load_file(rotated / "model.safetensors")
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64) / 2
    embed = "model.embed_tokens.weight"
    for start in (0, 44):
        part = new[embed][:, start:start + 4]
        if kind == "hadamard":
            assert torch.allclose(part, old[embed][:, start:start + 4] @ h4, atol=1e-12)
        else:  # the stored columns, each times a random sign, then the same Hadamard: diag(s) · H
            signs = (part @ h4.T) / old[embed][:, start:start + 4]
            assert torch.allclose(signs, signs[:1].sign().expand_as(signs), atol=1e-9)
    config = json.loads((rotated / "config.json").read_text())
    assert config["quantization_config"]["transform_config"] == r4_config(kind, 4)
    stored = [v for k, v in new.items() if k.endswith(f"{R4}_input.weight")]
    assert len(stored) == 1 and stored[0].shape == (4, 4) and torch.equal(stored[0].abs(), torch.ones(4, 4))


def test_a_block_that_does_not_divide_a_width_is_one_line(tmp_path):
    model = _random_model(tmp_path, CASES["llama"]())  # hidden 48, head 12, MLP 96
    for settings, needle in [({"block": 5}, "block 5 does not divide the width 48"),
                             ({"block": 12, "online": ["r4"], "kind": "hadamard"}, "block 12 is not a power of two")]:
        with pytest.raises(CompressError, match=needle) as caught:
            _rotate(model, tmp_path / "rotated", **settings)
        assert "\n" not in str(caught.value) and not (tmp_path / "rotated").exists()


def test_a_rotation_of_nothing_is_one_line(tmp_path):
    model = _random_model(tmp_path, CASES["llama"]())
    with pytest.raises(CompressError, match="nothing is rotated") as caught:
        _rotate(model, tmp_path / "rotated", residual=False, heads=False)
    assert "\n" not in str(caught.value) and not (tmp_path / "rotated").exists()


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
@pytest.mark.parametrize("case", ["llama", "qwen3-qk-norms"])
def test_online_inputs_rotate_every_linear_layer_and_keep_the_function(case, kind, residual, tmp_path):
    """``online: [inputs]`` (QuIP's V): every linear layer of every block has its input rotated at run time, one
    scheme per input width (48: q/k/v, o, gate/up; 96: down), Sylvester blocks of its largest power of two (16, 32)
    or one random Hadamard of the whole width, and the function is kept."""
    from torch import nn

    from compress.checkpoints.model_io import open_model
    from compress.checkpoints.transforms import INPUTS, ONLINE_ATTR

    model = _random_model(tmp_path, CASES[case]())
    rotated = _rotate(model, tmp_path / "rotated", kind=kind, residual=residual, online=["inputs"]).output
    _online_logits_match(model, rotated)
    scheme = json.loads((rotated / "config.json").read_text())["quantization_config"]["transform_config"]["config_groups"]
    assert {name: s["head_dim"] for name, s in scheme.items()} == (
        {f"{INPUTS}48": 16, f"{INPUTS}96": 32} if kind == "hadamard" else {f"{INPUTS}48": None, f"{INPUTS}96": None})
    linears = [m for block in open_model(rotated).blocks for m in block.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 14 and all(getattr(m, ONLINE_ATTR, None) is not None for m in linears)


def test_online_r4_and_inputs_together_are_one_line(tmp_path):
    model = _random_model(tmp_path, CASES["llama"]())
    with pytest.raises(CompressError, match="give r4 or inputs, once") as caught:
        _rotate(model, tmp_path / "rotated", online=["r4", "inputs"])
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("online", ["r4", "inputs"])
@pytest.mark.parametrize("stage", [None, {"method": "gptq", "bits": 4, "group_size": 16}])
def test_transformers_and_compressed_tensors_compute_our_r4_checkpoint(stage, online, tmp_path, tiny_tokenizer, monkeypatch):
    """The consumer: transformers loads the checkpoint with compressed-tensors (float, or W4A16 packed) and
    compressed-tensors' own `apply_transform_config` builds the transforms from its config, their tensors then loaded
    from the checkpoint (transformers#42887's order: transforms first, the checkpoint's weights over them)."""
    monkeypatch.undo()
    ct = pytest.importorskip("compressed_tensors.transform")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from compress.checkpoints.loading import load_model

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL))
    tiny_tokenizer.save_pretrained(model)
    rotate = {"method": "rotate", "kind": "random-hadamard", "online": [online]}
    recipe = {"model": model, "stages": [rotate] + ([stage] if stage else []), "output": {"path": tmp_path / "out"}}
    if stage:
        recipe["calibration"] = {"path": CALIB_TEXT, "samples": 4, "seq_len": 32}
    out = run_recipe(parse_recipe(recipe)).output
    config = json.loads((out / "config.json").read_text())
    stored = {k: v for k, v in load_file(out / "model.safetensors").items() if k.endswith("_input.weight")}
    firsts = ["mlp.down_proj.R4"] if online == "r4" else ["self_attn.q_proj.V48", "mlp.down_proj.V96"]
    assert sorted(stored) == sorted(f"model.layers.0.{f}_input.weight" for f in firsts)  # once per scheme, as compressed-tensors
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs(ids)  # a packed model decompresses on its first forward
        weights = {n: m.weight.clone() for n, m in theirs.named_modules() if n.endswith("_proj")}
        ct.apply_transform_config(theirs, ct.TransformConfig.model_validate(config["quantization_config"]["transform_config"]))
        for name, weight in weights.items():
            theirs.get_submodule(name).weight.copy_(weight)
        assert theirs.load_state_dict(stored, strict=False).unexpected_keys == []
        expected = theirs(ids).logits
        got = load_model(out, torch.device("cpu"), torch.float32)(ids).logits
    assert torch.allclose(got, expected, atol=1e-5 * expected.abs().max().item())


def test_what_cannot_take_r4_is_one_line(tmp_path, tiny_tokenizer):
    from typer.testing import CliRunner

    from compress.cli import app

    with pytest.raises(CompressError, match="experts are held fused") as caught:
        _r4_model(tmp_path / "moe", "hadamard", "mixtral")
    assert "\n" not in str(caught.value)
    model, rotated = _r4_model(tmp_path, "hadamard")
    tiny_tokenizer.save_pretrained(rotated)
    with pytest.raises(CompressError, match="only compressed-tensors loaders apply: write --format compressed-tensors or fake"):
        run_recipe(parse_recipe({"model": rotated, "stages": [{"method": "rtn", "bits": 4, "group_size": 16}],
                                 "output": {"path": tmp_path / "gptq", "format": "gptq"}}))
    for args, needle in [
        (["export", str(rotated), "-o", str(tmp_path / "r.gguf"), "--type", "f16"], "records online rotations"),
        (["export", str(model), "-o", str(tmp_path / "r.gguf"), "--type", "f16", "--rotate", "hadamard", "--rotate-online", "r4"],
         "llama.cpp applies no online transform"),
        (["quantize", str(model), "-o", str(tmp_path / "q"), "--rotate-online", "r4"], "--rotate-online needs --rotate"),
        (["quantize", str(model), "-o", str(tmp_path / "q"), "--no-rotate-fused"], "--no-rotate-fused needs --rotate"),
        (["quantize", str(model), "-o", str(tmp_path / "q"), "--rotate", "hadamard", "--no-rotate-fused"],
         "--no-rotate-fused leaves nothing to rotate"),
    ]:
        done = CliRunner().invoke(app, args)
        assert done.exit_code == 2 and needle in done.output, done.output
    assert not (tmp_path / "r.gguf").exists() and not (tmp_path / "q").exists()


def test_the_cli_rotates_only_online_with_no_rotate_fused(tmp_path, tiny_tokenizer):
    """``--rotate random-hadamard --no-rotate-fused --rotate-online inputs``: the recipe's ``residual: false, heads:
    false``; the stream's tensors are stored as they were, every layer's input is rotated online."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from compress.cli import app

    model = _random_model(tmp_path, tiny_llama_config(**_SMALL))
    tiny_tokenizer.save_pretrained(model)
    out = tmp_path / "out"
    done = CliRunner().invoke(app, ["quantize", str(model), "-o", str(out), "--method", "rtn", "--bits", "8", "--group-size", "16",
                                    "--rotate", "random-hadamard", "--no-rotate-fused", "--rotate-online", "inputs"])
    assert done.exit_code == 0, done.output
    old, new = load_file(model / "model.safetensors"), load_file(out / "model.safetensors")
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.allclose(old[name], new[name].to(old[name].dtype), rtol=1e-6), name  # block tensors pass the engine's float32
    schemes = json.loads((out / "config.json").read_text())["quantization_config"]["transform_config"]["config_groups"]
    assert sorted(schemes) == ["V48", "V96"]
