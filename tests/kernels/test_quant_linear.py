"""QuantLinear against a textbook dequantize-then-matmul (tests/references.py's float64 grid)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from references import random_weight, reference_grid
from compress.formats import compressed_tensors as ct
from compress.formats import gptq
from compress.kernels.quant_linear import QuantLinear
from compress.quantizers.activations import ActGranularity, ActivationScheme
from compress.quantizers.grid import QuantScheme
from compress.quantizers.rtn import rtn


def textbook_weight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """w[o, k] = s[o, k // G] * (q[o, k] - z[o, k // G]), element by element in float64."""
    out_f, in_f = codes.shape
    width = in_f if group_size == -1 else group_size
    w = np.zeros((out_f, in_f))
    c, s, z = codes.numpy(), scale.double().numpy(), zero.double().numpy()
    for o in range(out_f):
        for k in range(in_f):
            w[o, k] = s[o, k // width] * (c[o, k] - z[o, k // width])
    return torch.from_numpy(w).float()


@pytest.mark.parametrize("layout", ["pack-quantized", "gptq"])
@pytest.mark.parametrize("bits,symmetric,group_size", [(4, True, 32), (4, False, 32), (8, True, -1), (3, False, 32), (2, True, 64)])
def test_forward_equals_textbook_dequantized_matmul(layout, bits, symmetric, group_size):
    w = random_weight((48, 128), seed=bits + symmetric)
    bias = random_weight((48,), seed=9)
    quant = rtn(w, QuantScheme(bits, symmetric, group_size))
    if layout == "gptq":
        tensors = gptq.gptq_tensors(quant)
        deq = functools.partial(gptq.dequantize, bits=bits, group_size=group_size)
        expected_w = textbook_weight(quant.codes, quant.scale.half(), quant.zero, group_size)
    else:
        tensors = ct.pack_quantized_tensors(quant, torch.float32)
        deq = functools.partial(ct.dequantize_pack_quantized, bits=bits, symmetric=symmetric)
        expected_w = textbook_weight(quant.codes, quant.scale, quant.zero, group_size)
    layer = QuantLinear(128, 48, tensors, deq, bias=bias, layout=layout)
    x = random_weight((2, 5, 128), seed=11)
    # The codes themselves are the grid tests' business (tests/quantizers): here, what is stored decodes to them.
    codes, _, _, _, _ = reference_grid(w.numpy(), bits, symmetric, group_size)
    assert np.abs(quant.codes.numpy() - codes).max() <= 1  # sanity: the codes are the textbook grid's (ties aside)
    torch.testing.assert_close(layer.dequantized_weight(), expected_w, rtol=0, atol=1e-5)
    torch.testing.assert_close(layer(x), x @ expected_w.T + bias, rtol=1e-5, atol=1e-5)
    assert set(layer.state_dict()) == set(tensors) | {"bias"}


def test_packed_tensors_are_smaller_than_the_dense_weight():
    quant = rtn(random_weight((64, 256), 1), QuantScheme(4, True, 128))
    tensors = ct.pack_quantized_tensors(quant, torch.float32)
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert stored * 8 / (64 * 256) == pytest.approx(4 + 32 / 128, abs=0.01)


@pytest.mark.parametrize("static", [False, True])
def test_w8a8_forward_quantizes_inputs_like_an_int8_gemm(static):
    w = random_weight((16, 64), 3)
    quant = rtn(w, QuantScheme(8, True, -1))
    input_scale = torch.tensor(0.02) if static else None
    tensors = ct.int_quantized_tensors(quant, torch.float32, input_scale)
    act = ActivationScheme(8, ActGranularity.TENSOR if static else ActGranularity.TOKEN, not static, True)
    layer = QuantLinear(64, 16, tensors, ct.dequantize_int_quantized, activations=act, layout="int-quantized")
    x = random_weight((3, 64), 4)
    # Textbook: int8 inputs (symmetric, qmax 127; a static scale saturates to int8's [-128, 127], as vLLM's
    # static_scaled_int8_quant does) times int8 weights, rescaled.
    s_x = torch.full((3, 1), 0.02) if static else x.abs().amax(-1, keepdim=True) / 127
    q_x = torch.clamp(torch.round(x / s_x), -128 if static else -127, 127)
    q_w = tensors["weight"].float()
    expected = (q_x @ q_w.T) * s_x * tensors["weight_scale"].float().T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
