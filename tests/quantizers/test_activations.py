"""Int8 activation fake-quantization against a per-element reference."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.activations import ActGranularity, ActivationScheme, quantize_activations, static_scale


def test_per_token_dynamic_matches_elementwise_reference():
    x = torch.randn(2, 3, 16) * torch.tensor([1.0, 10.0, 0.01]).view(1, 3, 1)
    got = quantize_activations(x, ActivationScheme())
    for b in range(2):
        for t in range(3):
            s = x[b, t].abs().max().item() / 127
            for j in range(16):
                expected = max(-127, min(127, round(x[b, t, j].item() / s))) * s
                assert got[b, t, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_static_per_tensor_saturates_to_the_int8_range_beyond_the_calibrated_range():
    """vLLM's static_scaled_int8_quant (its CPU and CUDA kernels) saturates to int8's own [-128, 127]: -5 with
    scale 2/127 is stored as -128, i.e. -128 * s; the positive side stops at 127 * s."""
    scheme = ActivationScheme(8, ActGranularity.TENSOR, dynamic=False)
    scale = static_scale(torch.tensor([2.0, 1.0]), scheme)
    x = torch.tensor([[0.5, -1.0, 3.0, -5.0]])
    got = quantize_activations(x, scheme, scale)
    s = 2.0 / 127
    assert torch.allclose(got, torch.tensor([[round(0.5 / s) * s, round(-1.0 / s) * s, 2.0, -128 * s]]), atol=1e-6)


def test_rounding_ties_go_to_even_as_vllms_kernels_round():
    """vLLM's int8 quant kernels round x / s to nearest, ties to even (measured on its CPU build: 0.5 -> 0,
    1.5 -> 2, 2.5 -> 2, -2.5 -> -2 with s = 1)."""
    scheme = ActivationScheme(8, ActGranularity.TENSOR, dynamic=False)
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5]])
    assert quantize_activations(x, scheme, torch.tensor(1.0)).tolist() == [[0.0, 2.0, 2.0, -0.0, -2.0, -2.0]]


def test_inconsistent_schemes_are_rejected():
    with pytest.raises(ValueError):
        ActivationScheme(8, ActGranularity.TOKEN, dynamic=False)
    with pytest.raises(ValueError):
        quantize_activations(torch.ones(1, 2), ActivationScheme(8, ActGranularity.TENSOR, dynamic=False))


# -- float activations (FP8, NVFP4, MXFP4) ----------------------------------------------------------------
from compress.quantizers.activations import ActivationPreset  # noqa: E402


def test_fp8_per_token_and_per_group_are_torchs_cast_of_x_over_s():
    x = torch.randn(3, 5, 256) * torch.logspace(-3, 2, 5).view(1, 5, 1)
    got = quantize_activations(x, ActivationPreset.FP8_TOKEN.scheme())
    s = x.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(got, (x / s).to(torch.float8_e4m3fn).float() * s)
    got = quantize_activations(x, ActivationPreset.FP8_GROUP.scheme())
    g = x.reshape(3, 5, 2, 128)
    s = g.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(got, ((g / s).to(torch.float8_e4m3fn).float() * s).reshape(x.shape))


def test_fp8_static_per_tensor_saturates():
    scheme = ActivationPreset.FP8_TENSOR.scheme()
    scale = static_scale(torch.tensor([2.0, 1.0]), scheme)
    assert scale == 2.0 / 448
    x = torch.tensor([[0.5, -1.0, 3.0, -5.0]])
    assert torch.equal(quantize_activations(x, scheme, scale), torch.tensor([[0.5, -1.0, 2.0, -2.0]]))


@pytest.mark.parametrize("preset", [ActivationPreset.NVFP4, ActivationPreset.MXFP4])
def test_fp4_activations_are_compressed_tensors_dynamic_quantization(preset):
    """compressed-tensors' own forward quantization of inputs: dynamic scales (NVFP4: under the static global)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    x = torch.randn(2, 7, 64) * 3
    scheme = preset.scheme()
    if preset is ActivationPreset.NVFP4:
        args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                                dynamic="local", scale_dtype=torch.float8_e4m3fn)
        calibrated = x.abs().max() * 0.5  # a calibrated range below this batch's: values beyond it saturate
        global_scale = generate_gparam(-calibrated, calibrated)
        ours = quantize_activations(x, scheme, static_scale(calibrated, scheme))
        assert static_scale(calibrated, scheme) == global_scale
    else:
        args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, dynamic=True,
                                scale_dtype=torch.uint8)
        global_scale = None
        ours = quantize_activations(x, scheme)
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=global_scale)
    assert torch.equal(ours, fake_quantize(x, scale, zero, args, global_scale=global_scale))


def test_float_activation_schemes_are_validated():
    from compress.quantizers.activations import ActType

    with pytest.raises(ValueError):  # FP8 per token is dynamic
        ActivationScheme(8, ActGranularity.TOKEN, dynamic=False, type=ActType.FLOAT)
    with pytest.raises(ValueError):  # FP4 groups are 16 (NVFP4) or 32 (MXFP4)
        ActivationScheme(4, ActGranularity.GROUP, dynamic=True, type=ActType.FLOAT, group_size=64)
    with pytest.raises(ValueError):
        quantize_activations(torch.ones(1, 16), ActivationPreset.NVFP4.scheme())  # needs its global scale
    for preset in ActivationPreset:
        assert ActivationScheme.from_record(preset.scheme().to_record()) == preset.scheme()


def test_int4_per_token_is_compressed_tensors_dynamic_quantization():
    """W4A4's activations as compressed-tensors' own forward quantizes a dynamic symmetric int4 per-token input (its
    only consumer: no vLLM kernel takes int4 activations): s = max|x| / 7.5, codes -8..7."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * torch.logspace(-1, 1, 5)[:, None]
    x[0, 0, 3] = -x[0, 0].abs().max() * 2  # a token whose extreme is negative
    args = QuantizationArgs(num_bits=4, type="int", strategy="token", symmetric=True, dynamic=True)
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=None)
    got = quantize_activations(x, ActivationPreset.INT4_TOKEN.scheme())
    assert torch.equal(got, fake_quantize(x, scale, zero, args))
    s = x[0, 0].abs().max() / 7.5  # the textbook figures of that token
    assert torch.allclose(got[0, 0], torch.clamp(torch.round(x[0, 0] / s), -8, 7) * s, atol=1e-6)
