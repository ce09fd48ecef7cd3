"""Tests for compress.quantizers.grid against an independent float64 min-max reference.

The reference below is a deliberately slow textbook loop over rows and groups in numpy float64; it
shares no code with the library.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.quantizers.grid import (
    QuantScheme,
    compute_qparams,
    dequantize,
    fake_quantize,
    quantize,
)

from references import assert_codes_match, expand_groups, random_weight, reference_grid

BITS = list(range(2, 9))
GROUP_SIZES = [-1, 32, 128]
SHAPES = [(8, 256), (5, 128), (3, 64)]


def _cases():
    for bits in BITS:
        for sym in (True, False):
            for gs in GROUP_SIZES:
                for shape in SHAPES:
                    if gs != -1 and shape[1] % gs:
                        continue
                    yield pytest.param(bits, sym, gs, shape, id=f"b{bits}-{'sym' if sym else 'asym'}-g{gs}-{shape[0]}x{shape[1]}")


CASES = list(_cases())


# --------------------------------------------------------------------------------------------------
# Agreement with the independent reference


@pytest.mark.parametrize("bits,sym,gs,shape", CASES)
def test_grid_matches_reference(bits, sym, gs, shape):
    w = random_weight(shape, seed=bits * 100 + gs % 97 + shape[1])
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    ref_q, ref_s, ref_z, ref_deq, ratio = reference_grid(w.numpy(), bits, sym, gs)

    scale, zero = compute_qparams(w, scheme)
    n_groups = 1 if gs == -1 else shape[1] // gs
    assert scale.shape == (shape[0], n_groups) and zero.shape == (shape[0], n_groups)
    assert scale.dtype == torch.float32 and zero.dtype == torch.float32
    np.testing.assert_allclose(scale.numpy(), ref_s, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(zero.numpy(), ref_z)

    codes = quantize(w, scale, zero, scheme)
    assert codes.dtype == torch.int32
    assert codes.shape == w.shape
    assert_codes_match(codes.numpy(), ref_q, ratio, sym, bits)

    deq = dequantize(codes, scale, zero, scheme)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    s_full = expand_groups(ref_s, shape[1])
    same = codes.numpy() == ref_q
    d = np.abs(deq.numpy().astype(np.float64) - ref_deq)
    assert (d[same] <= 1e-5 * s_full[same] * 2**bits + 1e-7).all()
    assert (d[~same] <= s_full[~same] * (1 + 1e-5)).all()

    fq = fake_quantize(w, scheme)
    assert fq.dtype == torch.float32
    np.testing.assert_array_equal(fq.numpy(), deq.numpy())


# --------------------------------------------------------------------------------------------------
# Published properties of the min-max grid


@pytest.mark.parametrize("bits,sym,gs,shape", CASES)
def test_codes_in_range_and_error_at_most_half_step(bits, sym, gs, shape):
    w = random_weight(shape, seed=7 + bits)
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    scale, zero = compute_qparams(w, scheme)
    codes = quantize(w, scale, zero, scheme)
    assert codes.dtype == torch.int32
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2**bits - 1
    deq = dequantize(codes, scale, zero, scheme).double()
    err = (w.double() - deq).abs()
    s_full = expand_groups(scale.double().numpy(), shape[1])
    # Asymmetric: every weight is within [lo, hi], so within half a step of the grid.
    # Symmetric: the clamped top code (+max|w| -> 2**(b-1)-1) is also exactly half a step away.
    assert (err.numpy() <= 0.5 * s_full * (1 + 1e-4)).all(), float((err.numpy() / s_full).max())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs", GROUP_SIZES)
def test_symmetric_top_code_clamped(bits, gs):
    shape = (4, 128)
    w = random_weight(shape, seed=3).abs()  # all positive: the absmax element is the group maximum
    scheme = QuantScheme(bits=bits, symmetric=True, group_size=gs)
    scale, zero = compute_qparams(w, scheme)
    codes = quantize(w, scale, zero, scheme)
    width = shape[1] if gs == -1 else gs
    grouped = w.reshape(shape[0], -1, width)
    top = grouped.argmax(dim=-1)
    c = codes.reshape(shape[0], -1, width).gather(-1, top.unsqueeze(-1)).squeeze(-1)
    assert (c == 2**bits - 1).all()
    # its signed code is 2**(b-1) - 1: half a step below the real value
    deq = dequantize(codes, scale, zero, scheme).reshape(shape[0], -1, width)
    top_deq = deq.gather(-1, top.unsqueeze(-1)).squeeze(-1).double()
    expected = scale.double() * (2 ** (bits - 1) - 1)
    torch.testing.assert_close(top_deq, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_zero_exactly_representable(bits, sym):
    w = random_weight((6, 64), seed=11)
    w[2] = w[2].abs() + 0.1  # a row whose groups are all positive apart from the zeros
    w[3] = -(w[3].abs() + 0.1)  # ... and one all negative
    w[:, ::5] = 0.0
    for gs in (-1, 32):
        scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
        deq = fake_quantize(w, scheme)
        assert (deq[:, ::5] == 0.0).all()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("gs", [-1, 32])
def test_all_zero_group(bits, sym, gs):
    w = random_weight((4, 64), seed=5)
    w[1] = 0.0  # whole row: per-channel group and both 32-groups
    w[2, :32] = 0.0  # one group only (for gs=32)
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    scale, zero = compute_qparams(w, scheme)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.isfinite(zero).all()
    deq = dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme)
    assert torch.isfinite(deq).all()
    assert (deq[1] == 0).all()
    if gs == 32:
        assert (deq[2, :32] == 0).all()
    # Entirely zero weight too
    z = torch.zeros(3, 64)
    assert (fake_quantize(z, scheme) == 0).all()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", GROUP_SIZES)
def test_more_bits_never_increase_mse(sym, gs):
    w = random_weight((16, 256), seed=21)
    mses = []
    for bits in BITS:
        deq = fake_quantize(w, QuantScheme(bits=bits, symmetric=sym, group_size=gs))
        mses.append(float((w.double() - deq.double()).pow(2).mean()))
    for lo, hi in zip(mses, mses[1:]):
        assert hi <= lo, mses
    # roughly 4x per extra bit on Gaussian weights: a sanity check that the grid really refines
    assert mses[-1] < mses[0] / 100


@pytest.mark.parametrize("bits", [-1, 0, 1, 9, 16])
def test_scheme_rejects_bad_bits(bits):
    with pytest.raises(ValueError):
        QuantScheme(bits=bits)


@pytest.mark.parametrize("gs", [0, -2, -128])
def test_scheme_rejects_bad_group_size(gs):
    with pytest.raises(ValueError):
        QuantScheme(bits=4, group_size=gs)


@pytest.mark.parametrize("bits", BITS)
def test_scheme_accepts_valid(bits):
    s = QuantScheme(bits=bits, symmetric=False, group_size=-1)
    assert s.max_code == 2**bits - 1


def test_groups_and_width():
    assert QuantScheme(group_size=-1).groups(96) == 1
    assert QuantScheme(group_size=-1).group_width(96) == 96
    assert QuantScheme(group_size=32).groups(96) == 3
    assert QuantScheme(group_size=32).group_width(96) == 32
    assert QuantScheme(group_size=1).groups(5) == 5
    with pytest.raises(ValueError):
        QuantScheme(group_size=128).groups(96)
    with pytest.raises(ValueError):
        QuantScheme(group_size=32).groups(100)


def test_non_dividing_group_size_raises_in_qparams():
    with pytest.raises(ValueError):
        compute_qparams(random_weight((2, 100), seed=0), QuantScheme(bits=4, group_size=32))


@pytest.mark.parametrize("gs", GROUP_SIZES)
def test_symmetric_4bit_signed_codes(gs):
    w = random_weight((8, 256), seed=9) * 3
    scheme = QuantScheme(bits=4, symmetric=True, group_size=gs)
    scale, zero = compute_qparams(w, scheme)
    assert (zero == 8).all()
    signed = quantize(w, scale, zero, scheme) - zero.to(torch.int32).repeat_interleave(scheme.group_width(256), dim=1)
    assert int(signed.min()) >= -8 and int(signed.max()) <= 7
    assert int(signed.max()) == 7  # the positive extreme is clamped onto +7


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shrink", [0.5, 0.8, 0.95])
def test_shrink_narrows_scale(bits, sym, shrink):
    w = random_weight((5, 128), seed=13)
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=32)
    s1, z1 = compute_qparams(w, scheme)
    s2, z2 = compute_qparams(w, scheme, shrink=shrink)
    torch.testing.assert_close(s2.double(), s1.double() * shrink, rtol=1e-6, atol=0)
    torch.testing.assert_close(z2, z1, rtol=0, atol=0)
    # independent: shrunk reference range
    _, ref_s, _, _, _ = reference_grid(w.numpy(), bits, sym, 32)
    np.testing.assert_allclose(s2.numpy(), ref_s * shrink, rtol=1e-6)
    codes = quantize(w, s2, z2, scheme)
    assert int(codes.min()) >= 0 and int(codes.max()) <= scheme.max_code


def test_shrink_per_group_tensor():
    w = random_weight((5, 128), seed=17)
    scheme = QuantScheme(bits=4, symmetric=True, group_size=32)
    shrink = torch.linspace(0.5, 1.0, 20).reshape(5, 4)
    s1, _ = compute_qparams(w, scheme)
    s2, _ = compute_qparams(w, scheme, shrink=shrink)
    torch.testing.assert_close(s2, s1 * shrink, rtol=1e-6, atol=0)


def test_quantize_accepts_half_precision():
    w = random_weight((4, 64), seed=23)
    scheme = QuantScheme(bits=4, symmetric=False, group_size=32)
    w16 = w.half()
    s, z = compute_qparams(w16, scheme)
    codes = quantize(w16, s, z, scheme)
    ref_q, ref_s, _, _, ratio = reference_grid(w16.float().numpy(), 4, False, 32)
    np.testing.assert_allclose(s.numpy(), ref_s, rtol=1e-6)
    assert_codes_match(codes.numpy(), ref_q, ratio, False, 4)


@pytest.mark.parametrize("bits,sym,gs,shape", CASES[::5])
@pytest.mark.parametrize("shrink", [1.0, 0.6])
def test_rounding_error_is_the_round_trip_error(bits, sym, gs, shape, shrink):
    """The clipping search's fused ``w − deq(q(w))`` equals the reference grid's round trip, clipped codes too."""
    w = random_weight(shape, seed=bits + 7 * shape[0])
    scheme = QuantScheme(bits=bits, symmetric=sym, group_size=gs)
    scale, zero = compute_qparams(w, scheme, shrink=shrink)
    q = np.clip(np.rint(w.numpy() / expand_groups(scale.numpy(), shape[1])) + expand_groups(zero.numpy(), shape[1]), 0, 2**bits - 1)
    expected = w.numpy() - expand_groups(scale.numpy(), shape[1]) * (q - expand_groups(zero.numpy(), shape[1]))
    np.testing.assert_allclose(scheme.rounding_error(w, scale, zero).numpy(), expected, rtol=0, atol=1e-6)


def test_divide_is_the_correctly_rounded_quotient():
    """Not a product with the reciprocal (what CUDA does for ``tensor / number``): 7.5, 15, 448 and 6 have
    inexact float32 reciprocals, and the product misses the quotient by an ulp for some dividends."""
    from compress.quantizers.grid import divide

    t = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 3
    for value in (7.5, 15.0, 127.5, 448.0, 6.0):
        exact = (t.double() / value).float()  # float64 quotient rounded once: the correctly rounded float32 one
        assert torch.equal(divide(t, value), exact)
        assert not torch.equal(t * (torch.tensor(1.0) / torch.tensor(value)), exact)  # the product does differ


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("symmetric", [True, False])
def test_qparams_are_the_same_on_cuda(symmetric):
    from compress.quantizers.grid import compute_qparams

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    scheme = QuantScheme(4, symmetric, 64)
    for cpu, gpu in zip(compute_qparams(w, scheme), compute_qparams(w.cuda(), scheme)):
        assert torch.equal(cpu, gpu.cpu())


# --------------------------------------------------------------------------------------------------
# The full-range symmetric grid, against auto-round's int_sym written out as a float64 loop


def _full_range_reference(w: np.ndarray, bits: int, width: int):
    """Per group: the element of largest magnitude (the positive one on a tie) lands on code −2**(b−1), so the
    scale is ``−w_ext / 2**(b−1)``; codes ``clamp(rint(w/s), −2**(b−1), 2**(b−1) − 1)``, stored unsigned."""
    half = 2 ** (bits - 1)
    w = np.asarray(w, dtype=np.float64)
    rows, cols = w.shape
    scale = np.zeros((rows, cols // width))
    codes, ratio = np.zeros(w.shape, dtype=np.int64), np.zeros(w.shape)
    for r in range(rows):
        for g in range(cols // width):
            seg = w[r, g * width : (g + 1) * width]
            top, bottom = max(seg.max(), 0.0), min(seg.min(), 0.0)
            extreme = top if top >= -bottom else bottom
            s = -extreme / half if extreme != 0 else 1.0
            scale[r, g] = s
            for c in range(width):
                t = seg[c] / s
                codes[r, g * width + c] = int(min(max(np.rint(t), -half), half - 1)) + half
                ratio[r, g * width + c] = t
    return codes, scale, ratio


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs", [-1, 32])
def test_full_range_grid_matches_reference(bits, gs):
    w = random_weight((6, 128), seed=40 + bits)
    w[1, :32] = -w[1, :32].abs()  # a group whose extreme is negative: a positive scale
    w[2, :32] = w[2, :32].abs()  # and one whose extreme is positive: a negative scale
    w[3] = 0.0  # all-zero groups decode exactly
    scheme = QuantScheme(bits, True, gs, full_range=True)
    ref_q, ref_s, ratio = _full_range_reference(w.numpy(), bits, 128 if gs == -1 else gs)
    scale, zero = compute_qparams(w, scheme)
    np.testing.assert_allclose(scale.numpy(), ref_s, rtol=1e-6, atol=0)
    assert (zero == 2 ** (bits - 1)).all()
    codes = quantize(w, scale, zero, scheme)
    assert_codes_match(codes.numpy(), ref_q, ratio, True, bits)
    deq = dequantize(codes, scale, zero, scheme)
    # each group's extreme is reproduced (code 0), and the grid's step is 2**b / (2**b - 1) finer than min-max's
    width = 128 if gs == -1 else gs
    grouped, rebuilt = w.reshape(6, -1, width), deq.reshape(6, -1, width)
    at = grouped.abs().argmax(dim=-1, keepdim=True)
    torch.testing.assert_close(rebuilt.gather(-1, at), grouped.gather(-1, at), rtol=1e-6, atol=0)
    assert (deq[3] == 0).all()
    half_range = compute_qparams(w, QuantScheme(bits, True, gs))[0]
    live = half_range[[0, 1, 2, 4, 5]]
    torch.testing.assert_close(scale[[0, 1, 2, 4, 5]].abs() * (2**bits / (2**bits - 1)), live, rtol=1e-6, atol=0)


def test_full_range_is_symmetric_only():
    with pytest.raises(ValueError, match="full_range"):
        QuantScheme(4, False, 64, full_range=True)
