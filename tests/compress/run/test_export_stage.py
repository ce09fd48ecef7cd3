"""A recipe's ``export:`` section with a per-tensor plan: the types gguf-py reads back from the file."""

from __future__ import annotations

import pytest

from compress.errors import CompressError
from compress.run.recipe import parse_recipe
from compress.run.runner import run_recipe

gguf = pytest.importorskip("gguf")


def test_an_inline_export_plan_types_the_gguf_tensors(tiny_llama, tmp_path):
    recipe = parse_recipe({
        "model": tiny_llama, "output": {"path": tmp_path / "o", "format": "fake"},
        "stages": [{"method": "rtn", "bits": 8, "group_size": -1}],
        "export": {"path": tmp_path / "m.gguf", "type": "q4_1",
                   "plan": {"layers": {"re:mlp\\.down_proj": "q8_0", "model.layers.0.self_attn.v_proj": "q5_0"}}},
    })
    run_recipe(recipe)
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert (written["blk.0.ffn_down.weight"], written["blk.1.ffn_down.weight"]) == ("Q8_0", "Q8_0")
    assert (written["blk.0.attn_v.weight"], written["blk.1.attn_v.weight"]) == ("Q5_0", "Q4_1")  # unplanned: the type's
    assert written["blk.0.ffn_up.weight"] == "Q4_1"


@pytest.mark.parametrize("plan, needle", [
    ({"layers": {"re:down_proj": "w4g32"}}, "integer grid"),
    ({"layers": {"re:down_proj": "q9_k"}}, "unknown candidate"),
    ({"layers": {"re:down_proj": "q8_0"}, "target_bpw": 4}, "takes no target"),
])
def test_a_bad_export_plan_is_refused_before_any_stage_runs(plan, needle, tiny_llama, tmp_path):
    with pytest.raises(CompressError) as info:
        run_recipe(parse_recipe({"model": tiny_llama, "output": {"path": tmp_path / "o", "format": "fake"},
                                 "stages": [{"method": "rtn"}], "export": {"path": tmp_path / "m.gguf", "plan": plan}}))
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "o").exists() and not (tmp_path / "m.gguf").exists()
