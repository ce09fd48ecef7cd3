"""Importance-matrix collection and its llama.cpp file format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from compress.formats.gguf.imatrix import Imatrix, ImatrixEntry, read_imatrix, write_imatrix  # noqa: E402
from compress.export.imatrix import ImatrixConfig, collect_imatrix, run_imatrix  # noqa: E402
from conftest import CALIB_TEXT  # noqa: E402
from references import one_line_error  # noqa: E402


def test_first_block_entries_are_squared_normed_embeddings(tiny_llama):
    """Textbook check: the input of blk.0's q/k/v is RMSNorm(embedding) (weight times x/rms), so
    in_sum2 is the column sum of its squares over all tokens and count is the number of tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    entries = collect_imatrix(model, ids)
    emb = model.model.embed_tokens.weight.detach().double()[ids.reshape(-1)]
    norm = model.model.layers[0].input_layernorm
    x = emb / torch.sqrt((emb * emb).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.detach().double()
    expected = (x * x).sum(0).numpy()
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        assert entries[name].count == 120
        np.testing.assert_allclose(entries[name].in_sum2, expected, rtol=1e-5)
    assert "output.weight" not in entries and len(entries) == 7 * model.config.num_hidden_layers
    assert entries["blk.1.ffn_down.weight"].in_sum2.shape == (model.config.intermediate_size,)


def test_batches_cut_to_chunk_bytes_give_the_sums_of_a_float64_loop(tiny_llama):
    """``chunk_bytes`` (the heap's chunks, `compress export` with --calib) cuts the batches to a window each here: the
    sums are, bit for bit, those of batches of 8, and the exact float64 squares of each layer's input summed window by
    window in order (the textbook loop, the inputs recorded by a hook of its own)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    inputs, batches = [], []
    down = model.model.layers[1].mlp.down_proj
    down.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach().clone()))
    model.model.embed_tokens.register_forward_pre_hook(lambda _m, args: batches.append(args[0].shape[0]))
    chunked = collect_imatrix(model, ids, chunk_bytes=40 * model.config.intermediate_size * 4)  # one window's widest
    assert batches == [1, 1, 1]
    whole = collect_imatrix(model, ids)
    assert batches[3:] == [3]
    expected = torch.zeros(model.config.intermediate_size, dtype=torch.float64)
    for x in inputs[:3]:
        for row in x.reshape(-1, x.shape[-1]).double():
            expected += row * row
    assert whole.keys() == chunked.keys()
    for name in whole:
        np.testing.assert_array_equal(chunked[name].in_sum2, whole[name].in_sum2, err_msg=name)
        assert chunked[name].count == whole[name].count == 120
    np.testing.assert_allclose(chunked["blk.1.ffn_down.weight"].in_sum2, expected.numpy(), rtol=1e-13)


def test_the_output_layer_runs_only_for_its_entry(tiny_llama):
    """Without ``process_output`` no entry reads the logits: the output layer is not run at all, and the blocks' entries
    are those of the whole model's forward (summed here by a hook of the test's own)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    calls, inputs = [], []
    model.lm_head.register_forward_pre_hook(lambda _m, args: calls.append(1))
    model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].double()))
    entries = collect_imatrix(model, ids, batch_size=1)
    assert not calls and "output.weight" not in entries
    with torch.inference_mode():
        model(ids)
    x = inputs[-1].reshape(-1, model.config.intermediate_size)
    np.testing.assert_allclose(entries["blk.1.ffn_down.weight"].in_sum2, (x * x).sum(0).numpy(), rtol=1e-6)
    assert len(calls) == 1 and "output.weight" in collect_imatrix(model, ids, process_output=True)


def test_gpt2_entries_under_its_gguf_names(tiny_tokenizer):
    """GPT-2's Conv1D layers are found under llama.cpp's gpt2 names; blk.0's attn_qkv reads LayerNorm(token +
    position embeddings), computed here by the textbook formula."""
    from architectures import random_model

    model = random_model("gpt2", len(tiny_tokenizer))
    ids = torch.randint(0, len(tiny_tokenizer), (2, 30), generator=torch.Generator().manual_seed(1))
    entries = collect_imatrix(model, ids)
    t = model.transformer
    h = (t.wte.weight[ids] + t.wpe.weight[:30]).detach().double().reshape(-1, 64)
    ln = t.h[0].ln_1
    x = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + ln.eps)
    x = x * ln.weight.detach().double() + ln.bias.detach().double()
    np.testing.assert_allclose(entries["blk.0.attn_qkv.weight"].in_sum2, (x * x).sum(0).numpy(), rtol=1e-5)
    assert sorted(n.split(".", 2)[2] for n in entries if n.startswith("blk.1.")) == [
        "attn_output.weight", "attn_qkv.weight", "ffn_down.weight", "ffn_up.weight"]


def test_file_layout_is_llama_cpps(tmp_path):
    from gguf import GGUFReader, GGUFValueType

    sums = np.arange(1, 9, dtype=np.float64)
    path = tmp_path / "im.gguf"
    write_imatrix(path, Imatrix({"blk.0.attn_q.weight": ImatrixEntry(sums, 4)}, ["calib.txt"], 3, 512))
    reader = GGUFReader(str(path))
    fields = reader.fields
    assert fields["general.type"].contents() == "imatrix"
    assert "general.architecture" not in fields
    assert fields["imatrix.chunk_count"].types == [GGUFValueType.UINT32] and fields["imatrix.chunk_count"].contents() == 3
    assert fields["imatrix.chunk_size"].contents() == 512 and fields["imatrix.datasets"].contents() == ["calib.txt"]
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_q.weight.in_sum2"].tensor_type.name == "F32"
    assert list(tensors["blk.0.attn_q.weight.in_sum2"].shape) == [8, 1]  # ne = [in_features, n_mat]
    assert list(tensors["blk.0.attn_q.weight.counts"].shape) == [1, 1]
    back = read_imatrix(path)
    np.testing.assert_array_equal(back.entries["blk.0.attn_q.weight"].importance(), (sums / 4).astype(np.float32))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_run_writes_a_file_and_refuses_to_overwrite(tiny_llama, tmp_path):
    out = tmp_path / "im.gguf"
    result = run_imatrix(ImatrixConfig(tiny_llama, CALIB_TEXT, out, samples=2, seq_len=64))
    assert result["entries"] == 14 and result["chunks"] == 2 and out.is_file()
    assert read_imatrix(out).entries["blk.1.ffn_down.weight"].count == 128
    msg = one_line_error(run_imatrix, ImatrixConfig(tiny_llama, CALIB_TEXT, out, samples=2, seq_len=64))
    assert "--overwrite" in msg


@pytest.mark.parametrize("choice", ["auto", "float32", "bfloat16"])
def test_a_bfloat16_checkpoint_is_run_in_the_resolved_compute_dtype(tiny_llama, tmp_path, monkeypatch, choice):
    """`run_imatrix` loads the model in `resolve_compute_dtype`'s choice (auto: the checkpoint's bfloat16 where this
    CPU multiplies it natively, else float32), and the sums are the textbook squares of blk.0's input within that
    dtype's rounding of the activations."""
    from transformers import AutoModelForCausalLM

    from compress.checkpoints import loading
    from compress.checkpoints.loading import ComputeDtype, resolve_compute_dtype

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_llama / name).exists():
            (tmp_path / "bf16" / name).write_bytes((tiny_llama / name).read_bytes())
    loaded = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loaded.append(a[2]) or real(*a, **k))
    out = tmp_path / "im.gguf"
    run_imatrix(ImatrixConfig(tmp_path / "bf16", CALIB_TEXT, out, samples=2, seq_len=64, compute_dtype=ComputeDtype(choice)))
    expected_dtype = resolve_compute_dtype(ComputeDtype(choice), torch.bfloat16, torch.device("cpu"))[0]
    assert loaded == [expected_dtype]
    entry = read_imatrix(out).entries["blk.0.attn_q.weight"]
    assert entry.count == 128
    from compress.checkpoints.calibration import load_calibration
    from compress.checkpoints.loading import load_tokenizer

    ids = load_calibration(CALIB_TEXT, load_tokenizer(tiny_llama), 2, 64, 0)
    emb = model.model.embed_tokens.weight.detach().double()[ids.reshape(-1)]
    norm = model.model.layers[0].input_layernorm
    x = emb / torch.sqrt((emb * emb).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.detach().double()
    rtol = 1e-5 if expected_dtype == torch.float32 else 2e-2  # bfloat16 activations: 8 bits, errors of both signs
    np.testing.assert_allclose(entry.in_sum2, (x * x).sum(0).numpy(), rtol=rtol)


def test_reading_something_else_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert "imatrix" in one_line_error(read_imatrix, bad)
    assert "does not exist" in one_line_error(read_imatrix, tmp_path / "missing.gguf")


@pytest.mark.parametrize("tensor, value", [("in_sum2", -1.0), ("in_sum2", np.nan), ("in_sum2", np.inf), ("counts", -4.0)])
def test_negative_or_non_finite_entries_are_a_clear_error(tmp_path, tensor, value):
    """A sum of squares or a token count is never negative or NaN: such a file (damaged, or crafted) is refused by
    name, not passed on as weights to the encoders' fits."""
    from gguf import GGUFReader

    path = tmp_path / "im.gguf"
    write_imatrix(path, Imatrix({"blk.0.attn_q.weight": ImatrixEntry(np.arange(1, 9, dtype=np.float64), 4)}, ["c.txt"], 1, 8))
    read_imatrix(path)  # valid as written
    target = next(t for t in GGUFReader(str(path)).tensors if t.name.endswith(tensor))
    with open(path, "r+b") as f:  # overwrite the tensor's first value in place
        f.seek(int(target.data_offset))
        f.write(np.float32(value).tobytes())
    msg = one_line_error(read_imatrix, path)
    assert "blk.0.attn_q.weight" in msg and "negative or non-finite" in msg and "collect it again" in msg


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_experts_have_one_row_per_expert_over_their_routed_tokens(tmp_path, tiny_tokenizer, model_type):
    """llama-imatrix's MUL_MAT_ID branch: a stacked expert tensor's entry holds, for each expert, the sum of
    x² over the tokens the router sent to it and their count. Reference: transformers' own fused model, its
    experts module's inputs and top-k routing captured by a hook, the expert MLP computed from the fused
    ``gate_up_proj`` by hand (for ``ffn_down_exps``)."""
    from transformers import AutoModelForCausalLM
    from transformers.activations import ACT2FN

    from architectures import save_architecture
    from compress.checkpoints.model_io import open_model

    path = save_architecture(model_type, tmp_path / "moe", tiny_tokenizer)
    fused = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, len(tiny_tokenizer), (3, 24), generator=torch.Generator().manual_seed(2))
    seen = {}
    for i, layer in enumerate(fused.model.layers):
        layer.mlp.experts.register_forward_pre_hook(lambda _m, args, i=i: seen.setdefault(i, []).append((args[0], args[1])))
    with torch.inference_mode():
        fused(ids)
    entries = collect_imatrix(open_model(path).load_remaining(), ids)  # as run_imatrix loads an MoE: one nn.Linear per expert
    n_expert, act = fused.config.num_experts if model_type == "qwen2_moe" else fused.config.num_local_experts, ACT2FN[fused.config.hidden_act]
    for i, layer in enumerate(fused.model.layers):
        (hidden, top_k), = seen[i]
        gate_up = layer.mlp.experts.gate_up_proj.detach().double()
        want = {role: np.zeros((n_expert, width)) for role, width in (("gate", hidden.shape[1]), ("down", gate_up.shape[1] // 2))}
        counts = np.zeros(n_expert, dtype=np.int64)
        for e in range(n_expert):
            x = hidden[(top_k == e).any(-1)].double()
            counts[e] = int((top_k == e).sum())
            gate, up = (x @ gate_up[e].t()).chunk(2, dim=-1)
            want["gate"][e], want["down"][e] = (x * x).sum(0).numpy(), ((act(gate) * up) ** 2).sum(0).numpy()
        assert counts.sum() == ids.numel() * fused.config.num_experts_per_tok and (counts > 0).all()
        for role, reference in (("gate", want["gate"]), ("up", want["gate"]), ("down", want["down"])):
            entry = entries[f"blk.{i}.ffn_{role}_exps.weight"]
            assert entry.in_sum2.shape == reference.shape and entry.n_mat == n_expert
            np.testing.assert_array_equal(entry.counts(), counts)
            np.testing.assert_allclose(entry.in_sum2, reference, rtol=1e-5)
        assert entries[f"blk.{i}.ffn_gate_inp.weight"].count == ids.numel()  # the router: a dense entry, every token


def test_moe_entry_file_layout_is_llama_cpps(tmp_path):
    """An expert entry is written as llama-imatrix writes it (in_sum2 ne = [in, n_expert], counts ne = [1, n_expert])
    and read back per expert as llama-quantize's load_imatrix does: sums / count, all ones for an expert no token reached."""
    from gguf import GGUFReader

    sums, counts = np.arange(12, dtype=np.float64).reshape(3, 4) + 1, np.array([2, 0, 5])
    path = tmp_path / "moe.gguf"
    write_imatrix(path, Imatrix({"blk.0.ffn_up_exps.weight": ImatrixEntry(sums, counts)}, ["c.txt"], 1, 8))
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    assert list(tensors["blk.0.ffn_up_exps.weight.in_sum2"].shape) == [4, 3]
    assert list(tensors["blk.0.ffn_up_exps.weight.counts"].shape) == [1, 3]
    back = read_imatrix(path).entries["blk.0.ffn_up_exps.weight"]
    np.testing.assert_array_equal(back.importance(0), (sums[0] / 2).astype(np.float32))
    np.testing.assert_array_equal(back.importance(1), np.ones(4, dtype=np.float32))
    np.testing.assert_array_equal(back.importance(2), (sums[2] / 5).astype(np.float32))
    assert "another model" in one_line_error(back.importance)  # a stacked entry for a dense weight
    assert "another model" in one_line_error(back.importance, 3)
