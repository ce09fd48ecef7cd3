"""`compress prune --structured` / `--target-params` end to end: the smaller checkpoint loads in plain
transformers, computes exactly what the original did when only zeroed structures go, and bad specs are
one-line errors. A recipe chains it with distillation repair."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config
from typer.testing import CliRunner

from compress.cli import app
from conftest import CALIB_TEXT, save_random_model, tiny_llama_config

runner = CliRunner()
CALIB = ["--calib", str(CALIB_TEXT), "--samples", "4", "--seq-len", "32"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def zeroed_model(path, tokenizer):
    """A random 3-block Llama (hidden 64, 4/2 heads × 16, MLP 128) whose KV group 1, 32 MLP channels per
    block, 16 residual channels and block 1 contribute exactly nothing."""
    config = tiny_llama_config(len(tokenizer), num_hidden_layers=3)
    model = AutoModelForCausalLM.from_pretrained(save_random_model(config, path, tokenizer, seed=5))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randperm(64, generator=g)[:16]
    mlp = [torch.randperm(128, generator=g)[:32] for _ in range(3)]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, hidden] = 0
        for i, block in enumerate(model.model.layers):
            block.self_attn.v_proj.weight[16:32] = 0  # KV head 1: query heads 2, 3 output zero
            block.mlp.up_proj.weight[mlp[i]] = 0  # act(gate) * 0
            block.self_attn.o_proj.weight[hidden] = 0  # nothing is written to the zeroed residual channels
            block.mlp.down_proj.weight[hidden] = 0
        model.model.layers[1].self_attn.o_proj.weight.zero_()  # block 1 passes its input through
        model.model.layers[1].mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return path, sorted(set(range(64)) - set(hidden.tolist())), [sorted(set(range(128)) - set(m.tolist())) for m in mlp]


def test_pruning_zeroed_structures_keeps_the_logits(tmp_path, tiny_tokenizer):
    model_dir, kept_hidden, kept_mlp = zeroed_model(tmp_path / "m", tiny_tokenizer)
    out = tmp_path / "out"
    result = invoke("prune", model_dir, "-o", out, "--structured", "heads=2,mlp=96,hidden=48,layers=2", *CALIB, "--json")
    assert result.exit_code == 0, result.output
    config = AutoConfig.from_pretrained(out)  # plain transformers, no custom code
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.hidden_size) == (2, 2, 1, 16, 96, 48)
    assert config.rms_norm_eps == pytest.approx(1e-6 * 64 / 48)
    plan = json.loads((out / "structured_plan.json").read_text())
    assert plan["layers"] == [0, 2] and plan["kv_groups"] == [[0], [0]]
    assert plan["hidden"] == kept_hidden and plan["mlp"] == [kept_mlp[0], kept_mlp[2]]
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    pruned = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (pruned(ids).logits - original(ids).logits).abs().max() < 1e-5
    summary = json.loads(result.stdout)
    params = sum(p.numel() for p in pruned.parameters())
    assert f"→ {params:,} " in summary["notes"][1]
    record = json.loads((out / "config.json").read_text())["compression"]["stages"][0]
    assert record["method"] == "structured" and record["parameters"][1] == params


@pytest.mark.parametrize(("args", "needle"), [
    (["--structured", "heads=0.3x"], "is not a number"),
    (["--structured", "depth=2"], "not AXIS=VALUE"),
    (["--structured", "mlp=1.5"], "neither a fraction"),
    (["--structured", "heads=3"], "not a multiple of the 2 query heads per KV group"),
    (["--structured", "heads=0.2"], "removes none of 2 KV groups"),
    (["--structured", "hidden=30"], "hidden size of 30 is not a multiple of the 4 attention heads kept"),
    (["--structured", "layers=3"], "keeps 3 of 2"),
    (["--structured", "mlp=0.5", "--sparsity", "0.5"], "--sparsity is for unstructured"),
    (["--target-params", "1G"], "is not below the model's"),
    (["--target-params", "lots"], "not a parameter count"),
    (["--structured", ""], "give at least one of heads"),
])
def test_bad_specs_are_one_line_errors(args, needle, tmp_path, tiny_llama):
    result = invoke("prune", tiny_llama, "-o", tmp_path / "o", *args, *CALIB)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.output
    assert not (tmp_path / "o").exists()


def test_missing_calibration_and_unknown_architecture(tmp_path, tiny_llama, tiny_tokenizer):
    result = invoke("prune", tiny_llama, "-o", tmp_path / "o", "--structured", "mlp=0.5")
    assert result.exit_code == 2 and "needs calibration data" in result.output
    gpt2 = save_random_model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=len(tiny_tokenizer)), tmp_path / "g", tiny_tokenizer)
    result = invoke("prune", gpt2, "-o", tmp_path / "o", "--structured", "mlp=0.5", *CALIB)
    assert result.exit_code == 2 and "no layout for model_type 'gpt2'" in result.output
    assert not (tmp_path / "o").exists()


def test_target_params_keeps_a_hidden_size_llama_config_accepts(tmp_path, tiny_tokenizer):
    """SmolLM2-like: 6 query heads (3 per KV group), head_dim 8: LlamaConfig refuses a hidden size that is
    not a multiple of the heads, so the width search rounds to multiples of lcm(8, 6) = 24."""
    config = tiny_llama_config(len(tiny_tokenizer), hidden_size=96, head_dim=8, num_attention_heads=6, num_key_value_heads=2)
    model = save_random_model(config, tmp_path / "m", tiny_tokenizer, seed=3)
    before = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    result = invoke("prune", model, "-o", tmp_path / "o", "--target-params", str(before // 2), *CALIB)
    assert result.exit_code == 0, result.output
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "o")  # validates hidden_size % num_attention_heads
    assert pruned.config.hidden_size < 96 and pruned.config.head_dim == 8
    assert sum(p.numel() for p in pruned.parameters()) <= before // 2


def test_recipe_target_params_then_distillation_repair(tmp_path, tiny_llama):
    before = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_llama).parameters())
    target = before * 6 // 10
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tiny_llama}\ncalibration: {{path: {CALIB_TEXT}, samples: 4, seq_len: 32}}\n"
        f"stages:\n  - method: structured\n    target_params: {target}\n    heads: 2\n    layers: 1\n    block_score: kld\n"
        f"distill:\n  data: {CALIB_TEXT}\n  steps: 2\n  batch_size: 2\n  seq_len: 32\n"
        f"output: {{path: {tmp_path / 'out'}}}\n"
    )
    result = runner.invoke(app, ["run", str(recipe), "--json"])
    assert result.exit_code == 0, result.output
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() for p in student.parameters()) <= target
    assert student.config.num_attention_heads == 2 and student.config.num_hidden_layers == 1 and student.config.hidden_size % 8 == 0
    record = json.loads((tmp_path / "out" / "config.json").read_text())["compression"]
    assert record["stages"][0]["method"] == "distill" and record["history"][0]["stages"][0]["method"] == "structured"
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(recipe.read_text().replace("distill:", "  - method: rtn\ndistill:"))
    refused = runner.invoke(app, ["run", str(mixed)])
    assert refused.exit_code == 2 and "must be the only stage" in refused.output


def test_kv_cache_scales_beside_a_structured_stage_are_refused_not_dropped(tiny_llama, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tiny_llama}\ncalibration: {{path: {CALIB_TEXT}, samples: 4, seq_len: 32}}\n"
        f"stages:\n  - method: structured\n    mlp: 0.5\nkv_cache: {{format: fp8}}\noutput: {{path: {tmp_path / 'out'}}}\n"
    )
    refused = runner.invoke(app, ["run", str(recipe)])
    assert refused.exit_code == 2 and "without KV-cache scales" in refused.output, refused.output
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
