"""GGUF exports with per-tensor plans: the types gguf-py reads back, and the file size predicted beforehand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from compress.export.gguf import ExportConfig, export_gguf
from compress.export.sizing import fixed_gguf_bytes
from compress.formats.gguf.plan import Target
from compress.run.plan import PlanSpec, gguf_plan

gguf = pytest.importorskip("gguf")


def test_planned_types_are_written_and_the_size_is_predicted(tiny_llama, tmp_path):
    layers = {
        "model.embed_tokens": "q4_0", "lm_head": "q8_0", "model.layers.0.mlp.down_proj": "q5_0",
        "re:self_attn\\.v_proj": "q8_0", "model.layers.1.mlp.up_proj": "q4_k",  # width 64: falls back to Q5_0
    }
    config = ExportConfig(tiny_llama, tmp_path / "m.gguf", Target.q4_1)
    plan, types = gguf_plan(tiny_llama, PlanSpec(layers=layers), config)
    assert types["blk.1.ffn_up.weight"].name == "Q5_0" and types["output.weight"].name == "Q8_0"
    result = export_gguf(replace(config, types=types))
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(result.output).tensors}
    expected = {
        "token_embd.weight": "Q4_0", "output.weight": "Q8_0", "blk.0.ffn_down.weight": "Q5_0",
        "blk.0.attn_v.weight": "Q8_0", "blk.1.attn_v.weight": "Q8_0", "blk.1.ffn_up.weight": "Q5_0",
        "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_norm.weight": "F32",  # unplanned: the target's
    }
    assert {k: written[k] for k in expected} == expected
    assert not result.fallbacks
    fixed = fixed_gguf_bytes(config, set(types))
    predicted = fixed + plan.bytes
    assert abs(predicted - result.file_bytes) <= 1024 + 32 * len(types)  # provenance length and alignment


def test_gpt2_plan_names_and_row_lengths(tmp_path, tiny_tokenizer):
    """GPT-2's layers are planned under its own GGUF names, each Conv1D by its row length as stored (its input width)."""
    from architectures import save_architecture

    model = save_architecture("gpt2", tmp_path / "gpt2", tiny_tokenizer)
    config = ExportConfig(model, tmp_path / "m.gguf", Target.q8_0)
    layers = {"transformer.h.0.mlp.c_proj": "q4_k", "transformer.h.0.mlp.c_fc": "q4_k"}  # rows of 256 / 64 weights
    plan, types = gguf_plan(model, PlanSpec(layers=layers), config)
    assert {k: v.name for k, v in types.items()} == {"blk.0.ffn_down.weight": "Q4_K", "blk.0.ffn_up.weight": "Q5_0"}
    assert plan.sizes["transformer.h.0.mlp.c_proj"] == 64 * 144  # 64 rows of one Q4_K super-block (256 weights)
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(export_gguf(replace(config, types=types)).output).tensors}
    assert (written["blk.0.ffn_down.weight"], written["blk.0.ffn_up.weight"], written["blk.1.ffn_down.weight"]) == ("Q4_K", "Q5_0", "Q8_0")


def test_moe_plan_is_refused(tmp_path, tiny_tokenizer):
    from architectures import save_architecture
    from references import one_line_error

    model = save_architecture("qwen2_moe", tmp_path / "moe", tiny_tokenizer)
    config = ExportConfig(model, tmp_path / "m.gguf", Target.q8_0)
    assert "MoE experts" in one_line_error(gguf_plan, model, PlanSpec(layers={"model.layers.0.mlp.gate": "q8_0"}), config)


@pytest.mark.parametrize("layers, file_type", [
    ({"re:.*": "q8_0"}, 7),  # every matrix Q8_0: llama.cpp's MOSTLY_Q8_0, not the target's MOSTLY_Q4_1 (3)
    ({"model.layers.0.mlp.down_proj": "q8_0"}, 3),  # one small layer planned: still mostly Q4_1
    ({"re:.*": "q4_k"}, 8),  # rows of 64 weights: Q4_K falls back to Q5_0, and the label is what the file holds
])
def test_a_planned_file_is_labelled_by_the_type_holding_most_weights(layers, file_type, tiny_llama, tmp_path):
    config = ExportConfig(tiny_llama, tmp_path / "m.gguf", Target.q4_1)
    _, types = gguf_plan(tiny_llama, PlanSpec(layers=layers), config)
    reader = gguf.GGUFReader(export_gguf(replace(config, types=types)).output)
    assert int(reader.fields["general.file_type"].parts[-1][0]) == file_type
