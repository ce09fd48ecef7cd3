"""Float grids against independent references: torch's own float8_e4m3fn casts, the OCP E2M1 value table
with a brute-force nearest search, and compressed-tensors' scale computation and fake quantization."""

from __future__ import annotations

import math

import pytest
import torch

from references import one_line_error, random_weight
from compress.quantizers import float_grid as fg
from compress.quantizers.float_grid import FloatFormat, FloatGrid, FloatScheme

E4M3, E2M1 = FloatFormat.E4M3, FloatFormat.E2M1
OCP_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX v1.0, Table 5 (positive half; bit 3 is the sign)


def torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    """What torch's own cast stores (values beyond ±448 saturated first, as the format saturates)."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def e4m3_values() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite E4M3 value and its code, by viewing all 256 bytes as torch's float8_e4m3fn."""
    codes = torch.arange(256)
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~values.isnan()
    return values[finite], codes[finite].to(torch.int32)


def nearest_even_e2m1(x: float) -> float:
    """Textbook: the nearest of the OCP values (saturating); a tie goes to the even mantissa (codes 0, 2, 4, 6)."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(OCP_E2M1[i] - a), i % 2))
    return math.copysign(OCP_E2M1[best], x)


# -- element formats: exhaustive --------------------------------------------------------------------
def test_e4m3_table_is_torchs():
    codes = torch.arange(256)
    ours, theirs = fg.decode(codes, E4M3), codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(ours.isnan(), theirs.isnan()) and int(ours.isnan().sum()) == 2  # S.1111.111
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])
    values, value_codes = e4m3_values()
    assert torch.equal(fg.round_to_format(values, E4M3), values)  # representable values are fixed points
    assert torch.equal(fg.encode(values, E4M3), value_codes)  # and encode to their own byte (±0 included)
    assert float(values.max()) == E4M3.max == 448.0 and float(values[values > 0].min()) == 2.0**-9


def test_e4m3_rounding_is_torchs_cast_at_every_midpoint():
    values, _ = e4m3_values()
    v = values.unique()  # sorted, -0 merged into 0
    mid = (v[1:] + v[:-1]) / 2  # exact ties: the even mantissa must win
    step = (v[1:] - v[:-1]) * 1e-3
    x = torch.cat([mid, mid + step, mid - step, v, random_weight((20000,), 1) * 60, random_weight((5000,), 2) * 1e-2,
                   torch.tensor([448.0, 460.0, 464.0, 470.0, 1e6, -1e30, 2.0**-10, -(2.0**-11)])])
    ours = fg.round_to_format(x, E4M3)
    theirs = torch_e4m3(x)
    assert torch.equal(ours, theirs.float())
    assert torch.equal(fg.encode(ours, E4M3), theirs.view(torch.uint8).to(torch.int32))
    assert torch.equal(fg.round_to_codes(x, E4M3), theirs.view(torch.uint8).to(torch.int32))  # the quantizers' one-step path


def test_e2m1_table_and_rounding_by_brute_force():
    codes = torch.arange(16)
    assert fg.decode(codes, E2M1).tolist() == OCP_E2M1 + [-v for v in OCP_E2M1]
    values = torch.tensor(OCP_E2M1 + [-v for v in OCP_E2M1])
    assert torch.equal(fg.encode(values, E2M1), codes.to(torch.int32))  # -0.0 is code 8
    grid = sorted(set(OCP_E2M1))
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    x = torch.tensor(mids + [m + d for m in mids for d in (1e-4, -1e-4)] + [6.5, 7.0, 100.0, 0.1, 5.99])
    x = torch.cat([x, -x, random_weight((4000,), 3) * 3])
    ours = fg.round_to_format(x, E2M1)
    assert ours.tolist() == [nearest_even_e2m1(v) for v in x.tolist()]
    assert torch.equal(fg.round_to_codes(x, E2M1), fg.encode(ours, E2M1))


def test_e2m1_rounding_agrees_with_compressed_tensors():
    fp4 = pytest.importorskip("compressed_tensors.quantization.utils.fp4_utils")
    x = torch.cat([torch.linspace(-6.5, 6.5, 2601), random_weight((3000,), 4) * 2])
    assert torch.equal(fg.round_to_format(x, E2M1), fp4.cast_to_fp4(x.clone()))


# -- scales and fake quantization against compressed-tensors -----------------------------------------
def _ct_args(**kw):
    quant_args = pytest.importorskip("compressed_tensors.quantization.quant_args")
    return quant_args.QuantizationArgs(**kw)


def _ct_qparams(w: torch.Tensor, args, groups: int, global_scale=None):
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    g = w.reshape(w.shape[0], groups, -1)
    return calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=global_scale)[0]


@pytest.mark.parametrize("grid,group_size", [(FloatGrid.NVFP4, 16), (FloatGrid.MXFP4, 32), (FloatGrid.FP8, -1)])
def test_scales_and_fake_quantization_are_compressed_tensors(grid, group_size):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    w = random_weight((24, 128), 5) * 0.05
    w[3, :16] = 0.0  # an all-zero group
    w[5, 40] = 0.9  # an outlier: its group's scale saturates nothing, the others get small E4M3 scales
    if grid is FloatGrid.NVFP4:
        args = _ct_args(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                        scale_dtype=torch.float8_e4m3fn)
        theirs_global = generate_gparam(w.min(), w.max())
        theirs = _ct_qparams(w, args, 8, theirs_global)
    elif grid is FloatGrid.MXFP4:
        args = _ct_args(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype=torch.uint8)
        theirs_global, theirs = None, _ct_qparams(w, args, 4)
    else:
        args = _ct_args(num_bits=8, type="float", strategy="channel", symmetric=True)
        theirs_global, theirs = None, _ct_qparams(w, args, 1)
    scheme = FloatScheme(grid, group_size).fit(w)
    scale, zero = scheme.qparams(w)
    if theirs_global is not None:
        assert scheme.global_scale == float(theirs_global)
    nonzero = scale != 1.0 if grid is FloatGrid.FP8 else torch.ones_like(scale, dtype=torch.bool)  # zero rows: any scale
    assert torch.equal(scale[nonzero], theirs.float()[nonzero])
    ours = scheme.dequantize(scheme.quantize(w, scale, zero), scale, zero)
    expected = fake_quantize(w, scale, None, args, global_scale=theirs_global)
    assert torch.equal(ours, expected)


def test_fp8_block_and_tensor_scales_by_hand():
    w = random_weight((40, 64), 6)
    block = FloatScheme(FloatGrid.FP8, 32, block_rows=16)
    scale, _ = block.qparams(w)
    for r in (0, 15, 16, 39):
        for g in (0, 1):
            rows = slice(r // 16 * 16, min(r // 16 * 16 + 16, 40))  # the last block has 8 rows
            assert scale[r, g] == w[rows, g * 32 : (g + 1) * 32].abs().max() / 448
    tensor = FloatScheme(FloatGrid.FP8, -1, block_rows=-1)
    scale, zero = tensor.qparams(w)
    assert scale.shape == (40, 1) and bool((scale == w.abs().max() / 448).all())
    codes = tensor.quantize(w, scale, zero)
    assert torch.equal(codes, torch_e4m3(w / scale).view(torch.uint8).to(torch.int32))  # torch's cast of W / s
    assert torch.equal(tensor.dequantize(codes, scale, zero), torch_e4m3(w / scale).float() * scale)


def test_mx_scale_rounding_edges():
    # compressed-tensors rounds the absmax to a power of two up from mantissa 1.75, then divides by 4
    absmax = torch.tensor([1.0, 1.74, 1.75, 6.0, 7.0, 0.0, 2.0**-130])
    assert fg.mx_exponent(absmax).tolist() == [-2, -2, -1, 0, 1, -127, -127]
    assert torch.equal(fg.mx_scale(torch.tensor([-127, 0, 3])), torch.tensor([2.0**-127, 1.0, 8.0]))


def test_bad_schemes_and_missing_float8(monkeypatch):
    with pytest.raises(ValueError, match="group_size must be 16"):
        FloatScheme(FloatGrid.NVFP4, 32)
    with pytest.raises(ValueError, match="group_size must be 32"):
        FloatScheme(FloatGrid.MXFP4, 16)
    with pytest.raises(ValueError, match="block_rows"):
        FloatScheme(FloatGrid.NVFP4, 16, block_rows=16)
    with pytest.raises(ValueError, match="global scale"):
        FloatScheme(FloatGrid.NVFP4, 16).qparams(random_weight((2, 16), 0))
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert "float8_e4m3fn" in one_line_error(fg.require_float8)


# -- GPTQ on the float grids -------------------------------------------------------------------------
def textbook_float_gptq(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, grid: FloatGrid, damp: float = 0.01):
    """Slow OBQ in float64 with every column's effective scale fixed (``scale [out, in]``), columns in act-order
    (decreasing ``diag(H)``): each rounded to the nearest element of the value table (saturating; random data
    never hits an exact tie)."""
    table = torch.tensor(sorted({v for v in fg._value_table(grid.element) if not math.isnan(v)}), dtype=torch.float64)
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    W, H, S = w.double()[:, order], h.double()[order][:, order], scale[:, order]
    cols = W.shape[1]
    H += damp * float(torch.diagonal(H).mean()) * torch.eye(cols, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for i in range(cols):
        t = W[:, i] / S[:, i]
        Q[:, i] = table[(t.unsqueeze(1) - table).abs().argmin(dim=1)] * S[:, i]
        err = (W[:, i] - Q[:, i]) / Hinv[i, i]
        W[:, i + 1 :] -= torch.outer(err, Hinv[i, i + 1 :])
        Hinv -= torch.outer(Hinv[:, i], Hinv[i, :]) / Hinv[i, i]
    return Q[:, torch.argsort(order)]


@pytest.mark.parametrize("scheme", [FloatScheme(FloatGrid.NVFP4, 16), FloatScheme(FloatGrid.MXFP4, 32),
                                    FloatScheme(FloatGrid.FP8, 32, block_rows=16)], ids=lambda s: s.grid.value)
def test_gptq_on_float_grids_follows_the_textbook_and_beats_rtn(scheme):
    from references import correlated_layer

    from compress.quantizers.gptq import GPTQConfig, gptq

    w, h, _ = correlated_layer(32, 64, 512, seed=7)
    res = gptq(w, h, GPTQConfig(scheme, block_size=16, act_order=True))  # static groups: the grid fixed up front
    fitted = scheme.fit(w)
    scale, zero = fitted.qparams(w)
    assert res.scheme == fitted and res.codes.dtype == torch.int32 and torch.equal(res.scale, scale)
    assert torch.equal(res.weight, fitted.dequantize(res.codes, res.scale, res.zero))  # codes and weight agree
    effective = fg.effective_scale(scale, fitted).repeat_interleave(fitted.group_width(64), dim=1).double()
    ref = textbook_float_gptq(w, h, effective, scheme.grid)
    close = (res.weight.double() - ref).abs() <= 1e-5 * effective * fitted.grid.element.max
    assert close.all(), float(close.float().mean())

    def proxy(q):
        d = (w - q).double()
        return float(torch.einsum("oi,ij,oj->", d, h.double(), d))

    rounded = fitted.dequantize(fitted.quantize(w, scale, zero), scale, zero)  # RTN on the same grid
    assert proxy(res.weight) < 0.8 * proxy(rounded)
