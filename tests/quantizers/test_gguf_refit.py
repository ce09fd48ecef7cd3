"""The block scales' refit after GPTQ in GGML grids, against a dense float64 least-squares solve and gguf-py's decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

from compress.formats.gguf.sizes import BLOCK_SIZES, SCALE_FIELDS, GGMLType as G  # noqa: E402
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, gguf_gptq  # noqa: E402
from compress.quantizers.gguf_refit import refit_scales, worth_refitting  # noqa: E402
from references import correlated_layer  # noqa: E402

KINDS = [G.Q5_0, G.Q4_1, G.Q8_0, G.Q2_K, G.Q4_K, G.Q6_K, G.IQ4_XS, G.IQ2_XS]


def gguf_py(data: np.ndarray, kind: G) -> np.ndarray:
    return dequantize(data, kind).astype(np.float64)


def with_field(data: np.ndarray, kind: G, at: int, factor: float) -> np.ndarray:
    """``data`` with the float16 at byte ``at`` of every block times ``factor``."""
    block, size = BLOCK_SIZES[kind]
    blocks = data.copy().reshape(data.shape[0], -1, size)
    value = np.ascontiguousarray(blocks[:, :, at : at + 2]).view("<f2").astype(np.float32)
    blocks[:, :, at : at + 2] = (value * factor).astype("<f2").view(np.uint8)
    return blocks.reshape(data.shape)


def parts(data: np.ndarray, kind: G) -> list[np.ndarray]:
    """gguf-py's decode split into the part that scales with ``d`` and the part that scales with the min field."""
    whole = gguf_py(data, kind)
    d_at, min_at = SCALE_FIELDS[kind]
    if min_at is None:
        return [whole]
    scaled = gguf_py(with_field(data, kind, min_at, 0.0), kind)
    return [scaled, whole - scaled]


@pytest.mark.parametrize("kind", list(SCALE_FIELDS), ids=lambda k: k.name)
def test_scale_fields_are_where_ggml_reads_them(kind):
    """Doubling the float16 at each listed offset doubles exactly its part of gguf-py's decode (a wrong offset
    rewrites codes or sub-block scales instead)."""
    w, h, _ = correlated_layer(4, 512, 1024, seed=1)
    data = gguf_gptq(w, h, GGUFGPTQConfig(kind, refit_scales=False, compare_rtn=False)).data
    split = parts(data, kind)
    d_at, min_at = SCALE_FIELDS[kind]
    np.testing.assert_allclose(gguf_py(with_field(data, kind, d_at, 2.0), kind), 2 * split[0] + sum(split[1:]),
                               rtol=1e-6, atol=1e-9)
    if min_at is not None:
        np.testing.assert_allclose(gguf_py(with_field(data, kind, min_at, 2.0), kind), split[0] + 2 * split[1],
                                   rtol=1e-6, atol=1e-9)


def row_losses(w: torch.Tensor, q: np.ndarray, h: torch.Tensor) -> np.ndarray:
    e = w.double().numpy() - q
    return ((e @ h.double().numpy()) * e).sum(1)


def least_squares(w: torch.Tensor, h: torch.Tensor, data: np.ndarray, kind: G) -> tuple[np.ndarray, np.ndarray]:
    """Each row's optimum over its blocks' scale factors, the codes kept (a dense float64 solve, the columns of ``Z``
    built one block at a time), and a bound on what rounding the new scales to float16 may add to it: each factor
    ``α`` moves by at most half the float16 spacing at ``d·α`` over ``d`` (``ε``), so the loss by at most ``λmax(A)·Σε²``."""
    B = BLOCK_SIZES[kind][0]
    H = h.double().numpy()
    split = parts(data, kind)
    best, bound = np.empty(w.shape[0]), np.empty(w.shape[0])
    stored = fields(data, kind)
    for r in range(w.shape[0]):
        columns = []
        for part in split:
            for b in range(0, w.shape[1], B):
                z = np.zeros(w.shape[1])
                z[b : b + B] = part[r, b : b + B]
                columns.append(z)
        Z = np.stack(columns, 1)
        e = w[r].double().numpy() - sum(p[r] for p in split)
        A, g = Z.T @ H @ Z, Z.T @ H @ e
        delta = np.linalg.lstsq(A, g, rcond=1e-12)[0]
        rest = e - Z @ delta
        best[r] = rest @ H @ rest
        new = stored[r] * (1 + delta)  # each field's float16 moves by at most half its spacing there
        slack = np.spacing(np.abs(new).astype(np.float16)).astype(np.float64) / 2 / np.abs(stored[r])
        bound[r] = np.linalg.eigvalsh(A)[-1] * np.square(slack).sum()
    return best, bound


def fields(data: np.ndarray, kind: G) -> np.ndarray:
    """Each block's float16 scale, then each block's min field where there is one: ``[rows, P·blocks]``."""
    size = BLOCK_SIZES[kind][1]
    blocks = data.reshape(data.shape[0], -1, size)
    return np.concatenate([np.ascontiguousarray(blocks[:, :, at : at + 2]).view("<f2")[..., 0].astype(np.float64)
                           for at in SCALE_FIELDS[kind] if at is not None], 1)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_refit_reaches_the_least_squares_optimum(kind):
    """Each row's loss after the refit is at the dense solve's optimum but for the float16 rounding of the new
    scales, never above the row's loss before; the codes and every other byte are kept; the weight is gguf-py's
    decode of the new bytes; the gains are the losses' differences."""
    w, h, _ = correlated_layer(6, 512, 1024, seed=2)
    data = gguf_gptq(w, h, GGUFGPTQConfig(kind, refit_scales=False, compare_rtn=False)).data
    w0, h0, data0 = w.clone(), h.clone(), data.copy()
    out = refit_scales(w, h, data, kind)
    assert torch.equal(w, w0) and torch.equal(h, h0) and np.array_equal(data, data0)

    before, after = row_losses(w, gguf_py(data, kind), h), row_losses(w, gguf_py(out.data, kind), h)
    best, rounding = least_squares(w, h, data, kind)
    assert (after <= before * (1 + 1e-6)).all()
    assert (after - best <= rounding + 1e-6 * before).all() and (after >= best - 1e-6 * before).all(), (after - best, rounding)
    assert (before - best).sum() > 0.002 * before.sum()  # there was something to gain
    np.testing.assert_allclose(out.gain_rows.numpy(), before - after, rtol=1e-3, atol=1e-5 * before.max())  # float32 sums

    np.testing.assert_array_equal(out.weight.numpy(), gguf_py(out.data, kind).astype(np.float32))
    size = BLOCK_SIZES[kind][1]
    kept = np.ones(size, dtype=bool)
    for at in SCALE_FIELDS[kind]:
        if at is not None:
            kept[at : at + 2] = False
    blocks, new = data.reshape(6, -1, size), out.data.reshape(6, -1, size)
    np.testing.assert_array_equal(new[:, :, kept], blocks[:, :, kept])


@pytest.mark.parametrize("kind", [G.Q5_0, G.Q4_K, G.Q3_K], ids=lambda k: k.name)
def test_gptq_refits_below_eight_bits_and_reports_the_written_error(kind):
    """GPTQ's default refits the scales of types below 8 bits: the same codes, every row's loss at or below the
    unrefitted one, and the figures are those of the written bytes."""
    w, h, _ = correlated_layer(16, 512, 2048, seed=3)
    plain = gguf_gptq(w, h, GGUFGPTQConfig(kind, refit_scales=False))
    refit = gguf_gptq(w, h, GGUFGPTQConfig(kind))
    assert worth_refitting(kind) and not worth_refitting(G.Q8_0)
    before, after = row_losses(w, plain.weight.double().numpy(), h), row_losses(w, refit.weight.double().numpy(), h)
    assert (after <= before * (1 + 1e-6)).all() and after.sum() < before.sum()
    assert refit.stats["error"] == pytest.approx(after.sum(), rel=1e-4)
    np.testing.assert_allclose(refit.stats["error_rows"].numpy(), after, rtol=1e-3, atol=1e-6 * after.max())
    assert refit.stats["energy"] == pytest.approx(plain.stats["energy"], rel=1e-5)
    assert refit.stats["rtn_rel_error"] == pytest.approx(plain.stats["rtn_rel_error"], rel=1e-6)


def test_unsupported_type_is_refused():
    w, h, _ = correlated_layer(2, 64, 128, seed=4)
    with pytest.raises(ValueError, match="no float16 block scale"):
        refit_scales(w, h, np.zeros((2, 128), dtype=np.uint8), G.F16)
