"""Tests for compress.quantizers.autoround: a textbook float64 SignSGD loop on one linear layer, and properties
(no steps is RTN, the learned output error is at most RTN's, parameters and codes stay in range, the result decodes
to the weight the loss saw)."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.autoround import AutoRoundConfig, _order, autoround, autoround_linear
from compress.quantizers.autoround_grid import qdq
from compress.quantizers.grid import QuantScheme
from compress.quantizers.rtn import rtn

from references import shuffled_batches


def _layer(seed: int, out: int = 8, width: int = 64, samples: int = 6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, width, generator=g) * 0.05).to(dtype)
    xs = [torch.randn(5, width, generator=g).to(dtype) for _ in range(samples)]
    return w, xs


def _textbook(w, xs, bits, sym, gs, iters, lr, best, batch, seed=0):
    """AutoRound written out: float64, one group loop, each step one mean squared error over a mini-batch of
    ``batch`` samples (auto-round's IndexSampler: a seeded shuffled order, ``torch.randperm``, drawn in turn and
    reshuffled when fewer than ``batch`` remain), SignSGD with linear decay, V clamped to ±0.5 and α, β to [0, 1]."""
    out, width = w.shape
    n = width // gs
    top = 2**bits - 1
    batches = shuffled_batches(xs, batch, seed)
    v = torch.zeros(out, width, dtype=torch.float64)
    a = torch.ones(out, n, dtype=torch.float64)
    b = torch.ones(out, n, dtype=torch.float64)
    ste = lambda t: t + (torch.round(t) - t).detach()  # noqa: E731
    trail = []
    for t in range(iters):
        x = next(batches)
        y = x @ w.double().T
        v.requires_grad_(), a.requires_grad_(), b.requires_grad_()
        cols = []
        for k in range(n):
            wg, vg = w.double()[:, k * gs : (k + 1) * gs], v[:, k * gs : (k + 1) * gs]
            mx, mn = wg.max(dim=1).values * a[:, k], wg.min(dim=1).values * b[:, k]
            if sym == "full":  # auto-round's int_sym: the larger extreme (the maximum on a tie) onto code −2**(b−1)
                s = torch.where(mx >= -mn, -1.0, 1.0) * torch.maximum(mx, -mn).abs() / 2 ** (bits - 1)
                q = torch.clamp(ste(wg / s[:, None] + vg), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
                cols.append(q * s[:, None])
            elif sym:
                s = torch.maximum(mx, -mn).abs() / (top / 2)
                q = torch.clamp(ste(wg / s[:, None] + vg), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
                cols.append(q * s[:, None])
            else:
                s = (mx.clamp(min=0) - mn.clamp(max=0)) / top
                z = ste(-mn.clamp(max=0) / s)
                q = torch.clamp(ste(wg / s[:, None] + vg) + z[:, None], 0, top)
                cols.append(s[:, None] * (q - z[:, None]))
        loss = ((x @ torch.cat(cols, dim=1).T - y) ** 2).mean()
        loss.backward()
        trail.append((float(loss.detach()), v.detach().clone(), a.detach().clone(), b.detach().clone()))
        rate = lr * (1 - t / iters)
        with torch.no_grad():
            v = (v - rate * torch.sign(v.grad)).clamp(-0.5, 0.5)
            a = (a - rate * torch.sign(a.grad)).clamp(0, 1)
            b = (b - rate * torch.sign(b.grad)).clamp(0, 1)
    pick = min(range(iters), key=lambda i: trail[i][0]) if best else iters - 1
    return trail, pick


@pytest.mark.parametrize("sym", [True, False, "full"], ids=["sym", "asym", "full-range"])
@pytest.mark.parametrize("best", [True, False], ids=["best", "last"])
@pytest.mark.parametrize("batch", [6, 4], ids=["all", "mini"])  # 4 of 6: a reshuffle every step, the rest dropped
def test_matches_textbook_signsgd(sym, best, batch):
    w, xs = _layer(1, dtype=torch.float64)
    iters, lr = 12, 0.04
    trail, pick = _textbook(w, xs, 3, sym, 32, iters, lr, best, batch, seed=3)
    config = AutoRoundConfig(iters=iters, lr=lr, batch_size=batch, best=best, seed=3)
    result = autoround_linear(w, xs, config, QuantScheme(3, bool(sym), 32, full_range=sym == "full"))
    assert result.best_step == pick
    assert result.losses == pytest.approx([t[0] for t in trail], rel=1e-9)
    _, v, a, b = trail[pick]
    p = result.params["weight"]
    assert torch.equal(torch.sign(p.v), torch.sign(v)) and float((p.v - v).abs().max()) < 1e-12
    assert float((p.alpha - a).abs().max()) < 1e-12 and float((p.beta - b).abs().max()) < 1e-12
    assert float((p.v.abs()).max()) > 0 and float(p.alpha.min()) < 1  # the steps moved both kinds


@pytest.mark.parametrize("sym", [True, False, "full"], ids=["sym", "asym", "full-range"])
@pytest.mark.parametrize("gs", [-1, 16])
def test_no_steps_is_rtn(sym, gs):
    w, xs = _layer(2, out=6, width=48)
    grid = QuantScheme(4, bool(sym), gs, full_range=sym == "full")
    got, want = autoround_linear(w, xs, AutoRoundConfig(iters=0), grid).layers["weight"], rtn(w, grid)
    for field in ("weight", "codes", "scale", "zero"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_learned_output_error_at_most_rtn(sym):
    w, xs = _layer(3)
    grid = QuantScheme(3, sym, 32)
    result = autoround_linear(w, xs, AutoRoundConfig(iters=30, batch_size=len(xs)), grid)
    x = torch.cat(xs)
    error = lambda q: float(((x @ q.T - x @ w.T) ** 2).mean())  # noqa: E731
    learned, base = error(result.layers["weight"].weight), error(rtn(w, grid).weight)
    assert learned <= base * (1 + 1e-6)
    assert learned < 0.9 * base  # and it does learn


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_ranges_and_decoding(sym):
    w, xs = _layer(4)
    grid = QuantScheme(2, sym, 16)
    result = autoround_linear(w, xs, AutoRoundConfig(iters=15, lr=0.3, batch_size=2), grid)  # large steps hit the bounds
    layer, p = result.layers["weight"], result.params["weight"]
    assert float(p.v.abs().max()) == 0.5
    assert 0 <= float(p.alpha.min()) and float(p.alpha.max()) <= 1 and 0 <= float(p.beta.min()) and float(p.beta.max()) <= 1
    assert layer.codes.dtype == torch.int32 and 0 <= int(layer.codes.min()) and int(layer.codes.max()) <= grid.max_code
    assert torch.equal(layer.weight, grid.dequantize(layer.codes, layer.scale, layer.zero))
    assert torch.equal(layer.weight, qdq(w, p, grid).detach())  # the weight the chosen step's loss was taken on


def test_two_layers_learn_together():
    """The core takes any differentiable forward: two layers in a row, fitted to the float pair's output."""
    torch.manual_seed(5)
    w1, w2 = torch.randn(32, 64) * 0.05, torch.randn(16, 32) * 0.05
    xs = [torch.randn(4, 64) for _ in range(8)]
    forward = lambda ws, x: torch.relu(x @ ws["a"].T) @ ws["b"].T  # noqa: E731
    targets = [forward({"a": w1, "b": w2}, x) for x in xs]
    grids = {"a": QuantScheme(3, True, 32), "b": QuantScheme(3, True, 32)}
    result = autoround(forward, {"a": w1, "b": w2}, xs, targets, AutoRoundConfig(iters=25, batch_size=8), grids)
    assert result.losses[result.best_step] < 0.8 * result.losses[0]
    assert set(result.layers) == {"a", "b"}


def test_order_visits_every_sample_once_per_round():
    batches = _order(10, 3, seed=7)
    rounds = [sorted(sum((next(batches) for _ in range(3)), [])) for _ in range(4)]  # 9 of 10 per round, then reshuffle
    assert all(len(set(r)) == 9 and set(r) <= set(range(10)) for r in rounds)


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq_start_is_gptq_and_learns_from_it(sym):
    """Started at act-order GPTQ's dequantized weight (static min-max groups: RTN's grid), no steps give GPTQ's codes,
    scales and zeros exactly, and the kept step's loss is at most GPTQ's (on one layer GPTQ already minimizes it)."""
    from compress.quantizers.gptq import GPTQConfig, gptq

    w, xs = _layer(6, out=16, width=64, samples=8)
    grid = QuantScheme(3, sym, 32)
    x = torch.cat(xs)
    want = gptq(w, 2 * x.T @ x / len(x), GPTQConfig(grid, act_order=True, mse=False, refit_scales=False))
    start = {"weight": want.weight}
    forward = lambda ws, x: x @ ws["weight"].T  # noqa: E731
    targets = [x @ w.T for x in xs]
    got = autoround(forward, {"weight": w}, xs, targets, AutoRoundConfig(iters=0), {"weight": grid}, start).layers["weight"]
    for field in ("codes", "scale", "zero", "weight"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    learned = autoround(forward, {"weight": w}, xs, targets, AutoRoundConfig(iters=30, batch_size=8), {"weight": grid}, start)
    assert learned.losses[0] == pytest.approx(float(((x @ want.weight.T - x @ w.T) ** 2).mean()), rel=1e-5)
    assert learned.losses[learned.best_step] <= learned.losses[0] and len(set(learned.losses)) > 1  # the steps moved
