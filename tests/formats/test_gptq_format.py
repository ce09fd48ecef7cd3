"""GPTQ v1 files decoded by an independent unpacker written here from the published layout (formats.md §1.2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import CALIB_TEXT
from references import one_line_error, random_weight
from compress.errors import CompressError
from compress.formats import gptq
from compress.formats.base import PackedLayer
from compress.quantizers.grid import QuantScheme, dequantize, quantize
from compress.quantizers.result import QuantResult
from compress.quantizers.rtn import rtn


def _u32(x: torch.Tensor) -> np.ndarray:
    return x.numpy().astype(np.int64) & 0xFFFFFFFF


def unpack_gptq_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """qweight [in*b/32, out] -> Q [in, out], per AutoGPTQ: for b in {2,4,8},
    qweight[r, o] = sum_i Q[r*(32/b)+i, o] << (b*i); for b = 3, every 3 words hold 32 rows as
    10 codes | 1 split (2 low bits at 30-31, high bit at bit 0 of the next word) | 10 | 1 split | 10."""
    rows, cols = words.shape
    if bits != 3:
        per = 32 // bits
        out = np.zeros((rows * per, cols), dtype=np.int64)
        for r in range(rows):
            for i in range(per):
                out[r * per + i] = (words[r] >> (bits * i)) & ((1 << bits) - 1)
        return out
    out = np.zeros((rows // 3 * 32, cols), dtype=np.int64)
    for blk in range(rows // 3):
        w0, w1, w2 = words[3 * blk], words[3 * blk + 1], words[3 * blk + 2]
        base = 32 * blk
        for i in range(10):
            out[base + i] = (w0 >> (3 * i)) & 7
        out[base + 10] = ((w0 >> 30) & 3) | ((w1 & 1) << 2)
        for i in range(10):
            out[base + 11 + i] = (w1 >> (3 * i + 1)) & 7
        out[base + 21] = ((w1 >> 31) & 1) | ((w2 & 3) << 1)
        for i in range(10):
            out[base + 22 + i] = (w2 >> (3 * i + 2)) & 7
    return out


def unpack_gptq_cols(words: np.ndarray, bits: int) -> np.ndarray:
    """qzeros [G, out*b/32] -> [G, out]: the same packing along the last axis."""
    return unpack_gptq_rows(words.T, bits).T


def independent_dequant(tensors: dict[str, torch.Tensor], bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes Q [in, out], zero points Z = stored + 1 [G, out], and W [out, in] = s[g]*(Q - Z[g])."""
    q = unpack_gptq_rows(_u32(tensors["qweight"]), bits)
    z = unpack_gptq_cols(_u32(tensors["qzeros"]), bits) + 1
    s = tensors["scales"].numpy().astype(np.float64)
    g = tensors["g_idx"].numpy()
    w = np.stack([s[g[k]] * (q[k] - z[g[k]]) for k in range(q.shape[0])], axis=0).T
    return q, z, w


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_layer_tensors_decode_independently(bits, symmetric, group_size):
    w = random_weight((64, 96), seed=bits)
    quant = rtn(w, QuantScheme(bits, symmetric, group_size))
    tensors = gptq.gptq_tensors(quant)
    groups = 1 if group_size == -1 else 96 // group_size
    assert tensors["qweight"].dtype == torch.int32 and tuple(tensors["qweight"].shape) == (96 * bits // 32, 64)
    assert tuple(tensors["qzeros"].shape) == (groups, 64 * bits // 32)
    assert tensors["scales"].dtype == torch.float16 and tuple(tensors["scales"].shape) == (groups, 64)
    assert tensors["g_idx"].dtype == torch.int32 and tensors["g_idx"].tolist() == [k // (96 if group_size == -1 else group_size) for k in range(96)]
    q, z, deq = independent_dequant(tensors, bits)
    if (quant.zero >= 1).all():  # no v1 remap needed: codes and zeros stored exactly
        assert np.array_equal(q, quant.codes.t().numpy())
        assert np.array_equal(z, quant.zero.t().numpy())
    fp16_scale = quant.scale.half().float()
    expected = dequantize(quant.codes, fp16_scale, quant.zero, quant.scheme)
    np.testing.assert_allclose(deq, expected.numpy(), rtol=0, atol=1e-6)
    # Our torch reference decodes the same.
    torch.testing.assert_close(gptq.dequantize(tensors, bits), torch.from_numpy(deq).float(), rtol=0, atol=1e-6)


def test_symmetric_4bit_zero_words_are_0x77777777():
    tensors = gptq.gptq_tensors(rtn(random_weight((32, 64), 1), QuantScheme(4, True, 32)))
    assert set(_u32(tensors["qzeros"]).reshape(-1).tolist()) == {0x77777777}


def test_asymmetric_zero_point_of_zero_is_never_written():
    """A group with no negative weight has Z = 0; v1 stores Z - 1, so it is moved to Z = 1 exactly."""
    w = random_weight((8, 32), 2).abs()  # all groups non-negative -> Z = 0
    w[0, :16:2] = -w[0, :16:2]  # one group keeps a normal zero point
    scheme = QuantScheme(4, False, 16)
    scale = (w.reshape(8, 2, 16).amax(-1) - w.reshape(8, 2, 16).amin(-1).clamp(max=0)) / 14  # top code 15 unused
    zero = torch.round(-w.reshape(8, 2, 16).amin(-1).clamp(max=0) / scale)
    codes = quantize(w, scale, zero, scheme)
    quant = QuantResult(dequantize(codes, scale, zero, scheme), codes, scale, zero, scheme)
    assert (zero == 0).sum() >= 14 and int(codes.max()) <= 14
    tensors = gptq.gptq_tensors(quant)
    _, z, deq = independent_dequant(tensors, 4)
    assert z.min() >= 1  # never the wrapped 16
    np.testing.assert_allclose(deq, dequantize(codes, scale.half().float(), zero, scheme).numpy(), atol=1e-6)


def test_zero_point_remap_saturates_only_the_top_code():
    codes = torch.tensor([[0, 15, 7, 3], [1, 2, 3, 4]], dtype=torch.int32)
    zero = torch.tensor([[0], [5]], dtype=torch.int32)
    new_codes, new_zero, saturated = gptq.remap_zero_points(codes, zero, 15, 4)
    assert saturated == 1 and new_zero.tolist() == [[1], [5]]
    assert new_codes.tolist() == [[1, 15, 8, 4], [1, 2, 3, 4]]  # 15 - 0 = 15 steps became 15 - 1 = 14


def test_act_order_g_idx_is_honoured():
    """Rows of qweight stay in column order; g_idx sends each column to its (permuted) group."""
    g = torch.Generator().manual_seed(3)
    out_f, in_f, groups = 16, 64, 4
    g_idx = torch.randperm(in_f, generator=g) // (in_f // groups)
    codes = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.int32)
    scale = torch.rand(out_f, groups, generator=g) + 0.1
    zero = torch.randint(1, 15, (out_f, groups), generator=g).float()
    weight = scale[:, g_idx] * (codes - zero[:, g_idx])
    quant = QuantResult(weight, codes, scale, zero, QuantScheme(4, False, 16), g_idx=g_idx.to(torch.int32))
    tensors = gptq.gptq_tensors(quant)
    _, _, deq = independent_dequant(tensors, 4)
    expected = scale.half().float()[:, g_idx] * (codes - zero[:, g_idx])
    np.testing.assert_allclose(deq, expected.numpy(), atol=1e-6)
    torch.testing.assert_close(gptq.dequantize(tensors, 4), expected, rtol=0, atol=1e-6)
    layers = {"a": PackedLayer(quant.scheme, None, act_order=True, dynamic_groups=True)}
    config = gptq.GPTQFormat().config(layers, [])
    assert config["desc_act"] is True and config["static_groups"] is False


def test_gptq_format_refuses_what_it_cannot_store():
    fmt = gptq.GPTQFormat()
    assert "5" in one_line_error(fmt.check_stage, {"method": "rtn", "bits": 5})
    assert "W8A8" in one_line_error(fmt.check_stage, {"method": "smoothquant", "bits": 8, "activations": {"bits": 8}})
    layers = {"a": PackedLayer(QuantScheme(4, True, 32)), "b": PackedLayer(QuantScheme(8, True, 32))}
    one_line_error(fmt.config, layers, [])


def test_whole_model_gptq_output_decodes_independently(tmp_path, tiny_llama):
    """compress quantize --method gptq --format gptq, act-order: every layer decodes to the fake-quantized
    weights of --format fake (up to the fp16 scales the layout prescribes)."""
    from typer.testing import CliRunner

    from compress.cli import app

    common = ["quantize", str(tiny_llama), "--method", "gptq", "--bits", "4", "--group-size", "32", "--asym",
              "--calib", str(CALIB_TEXT), "--samples", "4", "--seq-len", "32", "-O", "act_order=true"]
    for fmt in ("gptq", "fake"):
        result = CliRunner().invoke(app, common + ["-o", str(tmp_path / fmt), "--format", fmt])
        assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 32, False, True)
    assert config["compression"]["format"] == "gptq"
    packed, fake = load_file(str(tmp_path / "gptq" / "model.safetensors")), load_file(str(tmp_path / "fake" / "model.safetensors"))
    layers = [k.removesuffix(".qweight") for k in packed if k.endswith(".qweight")]
    assert len(layers) == 14
    for name in layers:
        tensors = {s: packed[f"{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
        _, _, deq = independent_dequant(tensors, 4)
        ref = fake[f"{name}.weight"].double().numpy()
        assert np.abs(deq - ref).max() <= 2e-3 * np.abs(ref).max()  # fp16 scales: ~5e-4 relative
    assert "lm_head.weight" in packed and "model.layers.0.input_layernorm.weight" in packed


def test_validate_names_the_broken_tensor():
    tensors = gptq.gptq_tensors(rtn(random_weight((32, 64), 4), QuantScheme(4, True, 32)))
    gptq.validate("l", tensors, 4, 32, 32, 64)
    bad = {**tensors, "scales": tensors["scales"][:1]}
    assert "l.scales" in one_line_error(gptq.validate, "l", bad, 4, 32, 32, 64)
    missing = {k: v for k, v in tensors.items() if k != "qzeros"}
    assert "l.qzeros is missing" in one_line_error(gptq.validate, "l", missing, 4, 32, 32, 64)
    wild = {**tensors, "g_idx": tensors["g_idx"] + 5}
    assert "g_idx" in one_line_error(gptq.validate, "l", wild, 4, 32, 32, 64)
    with pytest.raises(CompressError):
        gptq.validate("l", tensors, 4, 32, 64, 64)
