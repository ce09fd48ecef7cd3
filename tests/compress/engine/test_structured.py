"""compress.engine.structured: block-by-block importance against a slow textbook pass over the whole
transformers model, and the output-change block score against models built without the block."""

from __future__ import annotations

import copy
import math

import torch
from transformers import AutoModelForCausalLM

from compress.checkpoints.architecture import structured_layout
from compress.checkpoints.model_io import open_model
from compress.engine.structured import block_output_change, collect_scores
from compress.pruners.structured import Geometry, make_plan, top_indices
from conftest import save_random_model, tiny_llama_config


def textbook_scores(model, ids: torch.Tensor, g: Geometry, batch: int):
    """Hooks on the whole model, then loops: per sample, mean over positions of each structure's norm,
    L2 over samples; hidden channels summed over every norm of every block; blocks 1 − cos(in, out)."""
    seen = {"o": [], "down": [], "norm": [], "io": []}
    hooks = []
    for i, block in enumerate(model.model.layers):
        hooks.append(block.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: seen["o"].append((i, a[0].double()))))
        hooks.append(block.mlp.down_proj.register_forward_pre_hook(lambda m, a, i=i: seen["down"].append((i, a[0].double()))))
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            hooks.append(norm.register_forward_hook(lambda m, a, out: seen["norm"].append(out.double())))
        hooks.append(block.register_forward_hook(
            lambda m, a, kw, out, i=i: seen["io"].append((i, (a[0] if a else kw["hidden_states"]).double(), (out[0] if isinstance(out, tuple) else out).double())),
            with_kwargs=True))
    with torch.no_grad():
        for chunk in ids.split(batch):
            model(input_ids=chunk, use_cache=False)
    for h in hooks:
        h.remove()

    def grouped(records, width, groups):
        out = torch.zeros(g.layers, groups, dtype=torch.float64)
        for layer, x in records:
            size = width // groups
            for b in range(x.shape[0]):
                for k in range(groups):
                    norms = (x[b, :, k * size:(k + 1) * size] ** 2).sum(dim=-1).sqrt()  # per position
                    out[layer, k] += float(norms.sum() / x.shape[1]) ** 2
        return out.sqrt()

    hidden = torch.zeros(g.hidden, dtype=torch.float64)
    for x in seen["norm"]:
        for b in range(x.shape[0]):
            hidden += x[b].abs().mean(dim=0) ** 2
    blocks, counts = torch.zeros(g.layers, dtype=torch.float64), torch.zeros(g.layers)
    for layer, a, b in seen["io"]:
        for u, v in zip(a.reshape(-1, g.hidden), b.reshape(-1, g.hidden)):
            blocks[layer] += 1 - float(u @ v) / math.sqrt(float(u @ u) * float(v @ v))
            counts[layer] += 1
    return grouped(seen["o"], g.heads * g.head_dim, g.heads), grouped(seen["down"], g.mlp, g.mlp), hidden.sqrt(), blocks / counts


def test_importance_matches_a_textbook_pass(tmp_path):
    config = tiny_llama_config(97, num_hidden_layers=3, hidden_size=32, intermediate_size=48)
    path = save_random_model(config, tmp_path / "m", seed=3)
    ids = torch.randint(0, 97, (5, 12), generator=torch.Generator().manual_seed(0))
    g = Geometry(layers=3, heads=4, kv_heads=2, head_dim=8, mlp=48, hidden=32)
    got = collect_scores(open_model(path), structured_layout("llama"), g, ids, torch.device("cpu"), batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    heads, mlp, hidden, blocks = textbook_scores(model, ids, g, batch=3)
    for name, ours, ref in (("heads", got.heads, heads), ("mlp", got.mlp, mlp), ("hidden", got.hidden, hidden), ("blocks", got.blocks, blocks)):
        assert torch.allclose(ours.double(), ref, rtol=2e-4, atol=1e-6), name
    assert top_indices(got.hidden, 20) == top_indices(hidden, 20)
    after = Geometry(layers=2, heads=2, kv_heads=1, head_dim=8, mlp=24, hidden=20)
    ours = make_plan(g, after, got.heads, got.mlp, got.hidden, got.blocks)
    assert ours == make_plan(g, after, heads.float(), mlp.float(), hidden.float(), blocks.float())


def test_output_change_of_a_block_is_the_kld_of_the_model_without_it(tmp_path):
    config = tiny_llama_config(61, num_hidden_layers=3, hidden_size=32, intermediate_size=48)
    model = AutoModelForCausalLM.from_pretrained(save_random_model(config, tmp_path / "m", seed=4)).eval()
    with torch.no_grad():  # block 1 adds nothing: skipping it changes nothing
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    ids = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(1))
    got = block_output_change(model, model.model.layers, ids, batch_size=2)
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits.double(), -1)
        for i in range(3):
            without = copy.deepcopy(model)
            without.model.layers = torch.nn.ModuleList([b for j, b in enumerate(without.model.layers) if j != i])
            for j, b in enumerate(without.model.layers):
                b.self_attn.layer_idx = j
            logp = torch.log_softmax(without(ids).logits.double(), -1)
            kld = float((ref.exp() * (ref - logp)).sum(-1).mean())
            assert math.isclose(float(got[i]), kld, rel_tol=1e-4, abs_tol=1e-7), i
    assert float(got[1]) < 1e-7 and float(got[0]) > 1e-4
