"""GGUF export of MoE checkpoints: experts stacked per block and role as llama.cpp's converter writes them,
layouts llama.cpp cannot run refused, and importance matrices with one row per expert."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from compress.export.gguf import ExportConfig, export_gguf  # noqa: E402
from compress.formats.gguf.plan import Target  # noqa: E402
from gguf_reference import read_fields  # noqa: E402
from references import one_line_error  # noqa: E402


def export(model, tmp_path, target: Target):
    out = tmp_path / f"model-{target.value}.gguf"
    return export_gguf(ExportConfig(model, out, target)), out


def test_moe_export_stacks_experts_as_llama_cpps_converter(tmp_path, tiny_tokenizer):
    """Qwen2-MoE as convert_hf_to_gguf.py writes it: expert counts and sizes in the metadata, each role's experts
    in one [n_expert, out, in] tensor, the router in F32, the shared expert under ``_shexp``."""
    from gguf import GGUFReader

    from architectures import save_architecture

    model = save_architecture("qwen2_moe", tmp_path / "moe", tiny_tokenizer)
    _, out = export(model, tmp_path, Target.q8_0)
    fields = read_fields(out)
    assert fields["general.architecture"] == "qwen2moe"
    assert (fields["qwen2moe.expert_count"], fields["qwen2moe.expert_used_count"]) == (4, 2)
    assert (fields["qwen2moe.expert_feed_forward_length"], fields["qwen2moe.expert_shared_feed_forward_length"]) == (32, 64)
    tensors = {t.name: ([int(d) for d in t.shape], t.tensor_type.name) for t in GGUFReader(str(out)).tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"] == ([64, 32, 4], "Q8_0") and tensors["blk.0.ffn_down_exps.weight"] == ([32, 64, 4], "Q8_0")
    assert tensors["blk.0.ffn_gate_inp.weight"] == ([64, 4], "F32") and tensors["blk.0.ffn_up_shexp.weight"] == ([64, 64], "Q8_0")
    assert tensors["blk.0.ffn_gate_inp_shexp.weight"] == ([64, 1], "F16")
    assert not [n for n in tensors if "experts" in n]


@pytest.mark.parametrize("overrides, words", [({"norm_topk_prob": True}, "norm_topk_prob"),
                                              ({"mlp_only_layers": [1]}, "dense")])
def test_moe_llama_cpp_cannot_run_is_refused(tmp_path, tiny_tokenizer, overrides, words):
    from architectures import save_architecture

    model = save_architecture("qwen2_moe", tmp_path / "moe", tiny_tokenizer, **overrides)
    msg = one_line_error(export_gguf, ExportConfig(model, tmp_path / "x.gguf", Target.q8_0))
    assert words in msg and not (tmp_path / "x.gguf").exists()


def test_moe_experts_are_rounded_with_their_own_imatrix_rows(tmp_path, tiny_tokenizer):
    """llama-quantize rounds expert e of a stacked tensor with row e of its imatrix entry: each expert's slice
    of ``ffn_gate_exps`` is that expert's weight encoded with its own row (and not with another's); an
    imatrix whose rows do not fit the tensor is a one-line error, as in llama-quantize."""
    from gguf import GGUFReader

    from architectures import save_architecture
    from compress.checkpoints.model_io import CheckpointReader, open_model
    from compress.export.imatrix import collect_imatrix
    from compress.formats.gguf.codecs import encode_tensor
    from compress.formats.gguf.imatrix import Imatrix, ImatrixEntry, write_imatrix
    from compress.formats.gguf.sizes import GGMLType

    model = save_architecture("qwen2_moe", tmp_path / "moe", tiny_tokenizer)
    ids = torch.randint(0, len(tiny_tokenizer), (4, 32), generator=torch.Generator().manual_seed(3))
    entries = collect_imatrix(open_model(model).load_remaining(), ids)
    imatrix = tmp_path / "im.gguf"
    write_imatrix(imatrix, Imatrix(entries, ["random"], 4, 32))
    out = tmp_path / "x.gguf"
    export_gguf(ExportConfig(model, out, Target.q4_0, imatrix=imatrix))
    stacked = next(t for t in GGUFReader(str(out)).tensors if t.name == "blk.1.ffn_gate_exps.weight")
    assert stacked.tensor_type.name == "Q4_0"
    written = np.asarray(stacked.data).reshape(4, -1)
    entry, reader = entries["blk.1.ffn_gate_exps.weight"], CheckpointReader(model)
    for e in range(4):
        w = reader.get(f"model.layers.1.mlp.experts.{e}.gate_proj.weight").float().numpy()
        own = encode_tensor(w, GGMLType.Q4_0, entry.importance(e)).reshape(-1)
        other = encode_tensor(w, GGMLType.Q4_0, entry.importance((e + 1) % 4)).reshape(-1)
        assert (written[e] == own).all() and (own != other).any()
    entries["blk.0.ffn_up_exps.weight"] = ImatrixEntry(np.ones((2, 64)), np.ones(2, dtype=np.int64))  # 2 experts, not 4
    write_imatrix(imatrix, Imatrix(entries, ["random"], 4, 32))
    msg = one_line_error(export_gguf, ExportConfig(model, tmp_path / "y.gguf", Target.q4_0, imatrix=imatrix))
    assert "blk.0.ffn_up_exps.weight" in msg and "another model" in msg and not (tmp_path / "y.gguf").exists()
