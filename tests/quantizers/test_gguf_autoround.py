"""Tests for compress.quantizers.gguf_autoround: no steps write the nearest codes of the type's own fit (ggml's bytes
for the k-quants), the learned loop equals a textbook float64 SignSGD loop on the fitted grid, learning lowers the
output error, and the written bytes decode to the weight the loss saw; from GPTQ's start (``init=gptq``) no steps
write GGUF GPTQ's bytes and steps keep its output error or lower it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.formats.gguf import grids
from compress.formats.gguf.codecs import CODECS, decode_tensor
from compress.formats.gguf.sizes import GGMLType
from compress.quantizers.autoround import AutoRoundConfig, autoround
from compress.quantizers.gguf_autoround import GGMLRounding, gptq_start, is_affine
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, gguf_gptq
from references import one_line_error, shuffled_batches

AFFINE = [GGMLType.Q4_K, GGMLType.Q3_K, GGMLType.Q6_K, GGMLType.Q2_K, GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q5_1]
K_QUANTS = {GGMLType.Q4_K, GGMLType.Q3_K, GGMLType.Q6_K, GGMLType.Q2_K}


def _layer(seed: int, out: int = 6, width: int = 512, samples: int = 6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, width, generator=g) * 0.05).to(dtype)
    xs = [torch.randn(5, width, generator=g).to(dtype) for _ in range(samples)]
    importance = torch.rand(width, generator=g) + 0.1
    return w, xs, importance


def _fit(w, config, rounding, xs):
    forward = lambda ws, x: x.to(ws["w"].dtype) @ ws["w"].T  # noqa: E731
    targets = [x.to(w.dtype) @ w.T for x in xs]
    return autoround(forward, {"w": w}, xs, targets, config, {"w": rounding})


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("kind", AFFINE, ids=lambda k: k.name)
def test_no_steps_write_the_nearest_codes_of_ggml_fit(kind, weighted):
    w, xs, importance = _layer(1)
    B = grids.block_size(kind)
    blocks = w.numpy().reshape(-1, B)
    if weighted:  # the layer's importance on every block of its columns, each block's row mean square (llama-quantize's)
        qw = np.broadcast_to(importance.numpy(), w.shape).reshape(-1, B)
        sigma2 = np.repeat((w.numpy() ** 2).mean(axis=1, keepdims=True), w.shape[1] // B, axis=0)
        grid = grids.fit(kind, blocks, qw, sigma2)
    else:
        grid = grids.fit(kind, blocks)
    want = grids.pack(grid, grid.codes(blocks)).reshape(w.shape[0], -1)
    got = _fit(w, AutoRoundConfig(iters=0), GGMLRounding.fit(kind, w, importance if weighted else None), xs).layers["w"]
    assert got.kind == kind and np.array_equal(got.data, want)
    if kind in K_QUANTS and not weighted:  # on these weights the k-quants' nearest codes are ggml's own encoding
        assert np.array_equal(got.data, CODECS[kind].encode(blocks).reshape(w.shape[0], -1))
    assert torch.equal(got.weight, torch.from_numpy(decode_tensor(want, kind, w.shape[1])))


def _textbook(w, xs, step, offset, lo, hi, iters, lr, best, batch, seed=0):
    """The learned rounding written out in float64 on a fixed grid: each step one mean squared output error over a
    mini-batch (a seeded shuffled order, reshuffled when fewer than ``batch`` remain), the code
    ``clamp(round((w + offset)/step + V), lo, hi)`` straight-through, SignSGD with linear decay, V clamped to ±0.5."""
    batches = shuffled_batches(xs, batch, seed)
    step, offset = torch.from_numpy(step).double(), torch.from_numpy(offset).double()
    v = torch.zeros_like(w, dtype=torch.float64)
    trail = []
    for t in range(iters):
        x = next(batches)
        v.requires_grad_()
        u = (w.double() + offset) / torch.where(step == 0, 1.0, step) + v
        q = torch.clamp(u + (torch.round(u) - u).detach(), lo, hi)
        loss = ((x @ (step * q - offset).T - x @ w.double().T) ** 2).mean()
        loss.backward()
        trail.append((float(loss.detach()), v.detach().clone()))
        with torch.no_grad():
            v = (v - lr * (1 - t / iters) * torch.sign(v.grad)).clamp(-0.5, 0.5)
    pick = min(range(iters), key=lambda i: trail[i][0]) if best else iters - 1
    return trail, pick


@pytest.mark.parametrize("kind", [GGMLType.Q4_K, GGMLType.Q4_0], ids=lambda k: k.name)
@pytest.mark.parametrize("best", [True, False], ids=["best", "last"])
def test_matches_textbook_signsgd(kind, best):
    w, xs, importance = _layer(2, dtype=torch.float64)
    rounding = GGMLRounding.fit(kind, w, importance)
    B = grids.block_size(kind)
    step, offset = (a.reshape(w.shape) for a in (rounding.grid.step, rounding.grid.offset))
    iters, lr = 12, 0.05
    trail, pick = _textbook(w, xs, step, offset, rounding.grid.lo, rounding.grid.hi, iters, lr, best, 4, seed=3)
    result = _fit(w, AutoRoundConfig(iters=iters, lr=lr, batch_size=4, best=best, seed=3, minmax_tuning=False), rounding, xs)
    assert result.best_step == pick
    assert result.losses == pytest.approx([t[0] for t in trail], rel=1e-9)
    v = result.params["w"].v
    assert float((v - trail[pick][1]).abs().max()) < 1e-12 and float(v.abs().max()) > 0
    layer = result.layers["w"]  # the bytes hold the chosen V's codes on the fitted grid
    u = (w.float().numpy() + offset) / np.where(step == 0, 1, step) + v.float().numpy()
    codes = np.where(step == 0, rounding.grid.lo, np.clip(np.rint(u), rounding.grid.lo, rounding.grid.hi)).astype(np.int32)
    assert np.array_equal(layer.data, grids.pack(rounding.grid, codes.reshape(-1, B)).reshape(w.shape[0], -1))


@pytest.mark.parametrize("kind", [GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q4_0], ids=lambda k: k.name)
def test_learning_lowers_the_output_error_and_the_bytes_decode_to_the_learned_weight(kind):
    w, xs, importance = _layer(3, out=8)
    rounding = GGMLRounding.fit(kind, w, importance)
    x = torch.cat(xs)
    error = lambda q: float(((x @ q.T - x @ w.T) ** 2).mean())  # noqa: E731
    nearest = _fit(w, AutoRoundConfig(iters=0), rounding, xs).layers["w"]
    result = _fit(w, AutoRoundConfig(iters=40, batch_size=len(xs), minmax_tuning=False), rounding, xs)
    learned = result.layers["w"]
    assert error(learned.weight) < 0.9 * error(nearest.weight)
    assert torch.allclose(learned.weight, rounding.qdq(w, result.params["w"]).detach(), rtol=0, atol=1e-6)
    assert float(result.params["w"].v.abs().max()) <= 0.5 and result.params["w"].alpha.numel() == 0


@pytest.mark.parametrize("kind", [GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.IQ3_S, GGMLType.IQ2_XS], ids=lambda k: k.name)
def test_codebook_and_lattice_types_are_refused_in_one_line(kind):
    assert not is_affine(kind)
    message = one_line_error(GGMLRounding.fit, kind, torch.zeros(2, 256))
    assert kind.name in message and "--method gptq or imatrix" in message


def _hessian(xs):
    x = torch.cat(xs).double()
    return (2 * x.T @ x / x.shape[0]).float()


@pytest.mark.parametrize("kind", AFFINE, ids=lambda k: k.name)
def test_gptq_start_without_steps_writes_gguf_gptqs_bytes(kind):
    """GPTQ's grids read back from its bytes and its columns as it rounded them: the nearest codes on those grids are
    GPTQ's, byte for byte (the reference: `gguf_gptq`'s own file bytes)."""
    w, xs, _ = _layer(4, width=256 if grids.block_size(kind) == 256 else 512, samples=40)
    config = GGUFGPTQConfig(kind, compare_rtn=False, refit_scales=False)
    want = gguf_gptq(w, _hessian(xs), config)
    rounding, start = gptq_start(w, _hessian(xs), config)
    forward = lambda ws, x: x @ ws["w"].T  # noqa: E731
    got = autoround(forward, {"w": w}, xs, [x @ w.T for x in xs], AutoRoundConfig(iters=0), {"w": rounding},
                    {"w": start}).layers["w"]
    assert np.array_equal(got.data, want.data) and torch.equal(got.weight, want.weight)
    # the grids are GPTQ's: its decoded weight is on them, each value a whole number of steps above −offset
    t = (want.weight.numpy() + rounding.offset.numpy()) / np.where(rounding.step.numpy() == 0, 1, rounding.step.numpy())
    assert np.abs(t - np.rint(t)).max() < 1e-3


@pytest.mark.parametrize("kind", [GGMLType.Q4_K, GGMLType.Q3_K, GGMLType.Q4_0], ids=lambda k: k.name)
def test_steps_from_gptq_move_codes_and_keep_the_output_error_at_most_gptqs(kind):
    """Learned from GPTQ's start on every sample at once: the first step's loss is GPTQ's output error, some step
    moves codes (``V`` reaches GPTQ's rounding boundaries), and the kept weight's error, measured here, is at most
    GPTQ's."""
    w, xs, _ = _layer(5, out=8, width=256, samples=48)
    config = GGUFGPTQConfig(kind, compare_rtn=False, refit_scales=False)
    gptq_weight = gguf_gptq(w, _hessian(xs), config).weight
    rounding, start = gptq_start(w, _hessian(xs), config)
    x = torch.cat(xs)
    error = lambda q: float(((x @ q.T - x @ w.T) ** 2).mean())  # noqa: E731
    forward = lambda ws, x: x @ ws["w"].T  # noqa: E731
    config = AutoRoundConfig(iters=30, batch_size=len(xs), minmax_tuning=False)
    result = autoround(forward, {"w": w}, xs, [x @ w.T for x in xs], config, {"w": rounding}, {"w": start})
    assert result.losses[0] == pytest.approx(error(gptq_weight), rel=1e-5)
    assert len(set(result.losses)) > 1
    assert error(result.layers["w"].weight) <= error(gptq_weight) * (1 + 1e-6)
