"""On-disk names against the model's, by transformers' own conversion mappings; MoE experts unfused per expert.

References: transformers' ``from_pretrained`` (its renamed, fused parameters) for what each on-disk tensor is.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from architectures import save_architecture
from compress.checkpoints.experts import UnfusedExperts, expert_layers, router_layers
from compress.checkpoints.model_io import open_model, quantizable_layers


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_tokenizer):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = save_architecture(arch, tmp_path_factory.mktemp(arch) / arch, tiny_tokenizer)
        return cache[arch]

    return get


def test_gpt_neox_output_layer_is_read_and_written_as_embed_out(saved):
    handle = open_model(saved("gpt_neox"))
    assert handle.checkpoint_key("lm_head.weight") == "embed_out.weight"
    assert handle.disk_name("lm_head.weight") == "embed_out.weight"
    assert handle.disk_name("lm_head.weight_packed") == "embed_out.weight_packed"  # new tensors of the module too
    assert handle.disk_name("gpt_neox.layers.0.attention.dense.weight") == "gpt_neox.layers.0.attention.dense.weight"


@pytest.mark.parametrize("arch, projections, prefix", [
    ("mixtral", ("w1", "w3", "w2"), "model.layers.{b}.block_sparse_moe.experts"),
    ("qwen2_moe", ("gate_proj", "up_proj", "down_proj"), "model.layers.{b}.mlp.experts"),
    ("qwen3_moe", ("gate_proj", "up_proj", "down_proj"), "model.layers.{b}.mlp.experts"),
])
def test_fused_experts_become_one_linear_per_on_disk_projection(saved, arch, projections, prefix):
    """Each expert's gate/up/down layer holds exactly the slice of transformers' fused parameters that
    from_pretrained merged it into, under the checkpoint's own per-expert name."""
    path = saved(arch)
    fused = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[0].mlp.experts
    inter = fused.down_proj.shape[2]
    handle = open_model(path)
    experts = handle.blocks[0].mlp.experts
    assert isinstance(experts, UnfusedExperts)
    handle.materialize(experts, "model.layers.0.mlp.experts", "cpu", torch.float32)
    gate, up, down = projections
    for e in range(fused.gate_up_proj.shape[0]):
        assert torch.equal(experts.get_submodule(f"{e}.{gate}").weight, fused.gate_up_proj[e, :inter])
        assert torch.equal(experts.get_submodule(f"{e}.{up}").weight, fused.gate_up_proj[e, inter:])
        assert torch.equal(experts.get_submodule(f"{e}.{down}").weight, fused.down_proj[e])
        assert handle.disk_name(f"model.layers.0.mlp.experts.{e}.{up}.weight_packed") == \
            f"{prefix.format(b=0)}.{e}.{up}.weight_packed"
    assert len(expert_layers(handle.model)) == 2 * 4 * 3


def test_routers_stay_out_of_the_default_selection(saved):
    handle = open_model(saved("qwen2_moe"))
    blocks = [handle.block_name(i) for i in range(len(handle.blocks))]
    assert router_layers(handle.model) == {"model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.shared_expert_gate"}
    default = quantizable_layers(handle.model, blocks)
    assert not router_layers(handle.model) & set(default)
    assert "model.layers.0.mlp.experts.3.down_proj" in default and "model.layers.0.mlp.shared_expert.up_proj" in default
    assert "model.layers.0.mlp.shared_expert_gate" in quantizable_layers(handle.model, blocks, include=["shared_expert_gate"])
