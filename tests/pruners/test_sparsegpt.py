"""Tests for compress.pruners.sparsegpt against the slow column-by-column reference (tests/references.py).

The reference is float64 with the full inverse Hessian eliminated after every column (no Cholesky, no
lazy blocks) and chooses masks by the same OBS-saliency rule from its own arithmetic; masks must agree
exactly and weights within float32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from compress.pruners.magnitude import MagnitudeConfig, magnitude
from compress.pruners.masks import NM, Unstructured
from compress.pruners.sparsegpt import SparseGPTConfig, sparsegpt
from compress.pruners.wanda import WandaConfig, wanda
from compress.quantizers.grid import QuantScheme, dequantize, fake_quantize

from references import correlated_layer, reference_sparsegpt

OUT, IN, TOKENS = 32, 128, 512
PATTERNS = [Unstructured(0.5), Unstructured(0.7), NM(2, 4), NM(4, 8)]


def proxy_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = w.double() - q.double()
    return float(torch.einsum("oi,ij,oj->", d, h.double(), d))


def reference(w, h, pattern, block_size, damp=0.01):
    if isinstance(pattern, NM):
        return reference_sparsegpt(w, h, nm=(pattern.n, pattern.m), block_size=block_size, damp=damp)
    return reference_sparsegpt(w, h, sparsity=pattern.sparsity, block_size=block_size, damp=damp)


def check_sparsity(pruned: torch.Tensor, weight: torch.Tensor, pattern) -> None:
    assert (weight[pruned] == 0).all()
    if isinstance(pattern, NM):
        kept = (~pruned).reshape(pruned.shape[0], -1, pattern.m).sum(dim=2)
        assert (kept == pattern.n).all()  # exactly N kept in every group of M
    else:
        assert abs(float(pruned.float().mean()) - pattern.sparsity) <= 0.001


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_matches_slow_reference(pattern, block_size):
    w, h, _ = correlated_layer(OUT, IN, TOKENS, seed=3)
    w0, h0 = w.clone(), h.clone()
    res = sparsegpt(w, h, SparseGPTConfig(pattern, block_size=block_size))
    ref = reference(w, h, pattern, block_size)
    assert torch.equal(w, w0) and torch.equal(h, h0)
    assert res.weight.shape == res.pruned.shape == (OUT, IN) and res.quant is None
    assert torch.equal(res.pruned, ref["pruned"]), int((res.pruned != ref["pruned"]).sum())
    torch.testing.assert_close(res.weight.double(), ref["weight"], rtol=1e-4, atol=1e-5)
    check_sparsity(res.pruned, res.weight, pattern)
    assert res.stats["lambda"] == pytest.approx(ref["lam"], rel=1e-5)
    assert res.stats["sparsity"] == pytest.approx(float(res.pruned.float().mean()))


def test_dead_columns_match_reference():
    w, _, x = correlated_layer(OUT, IN, TOKENS, seed=4)
    dead = [0, 7, 64, 127]
    x[dead] = 0.0
    h = 2.0 / TOKENS * (x @ x.T)
    res = sparsegpt(w, h, SparseGPTConfig(Unstructured(0.5), block_size=64))
    ref = reference(w, h, Unstructured(0.5), 64)
    assert torch.equal(res.pruned, ref["pruned"]) and (res.weight[:, dead] == 0).all()
    torch.testing.assert_close(res.weight.double(), ref["weight"], rtol=1e-4, atol=1e-5)
    assert res.stats["dead_columns"] == len(dead)


@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_beats_magnitude_and_wanda_on_correlated_inputs(pattern):
    # Blocks of 32 of 128 columns: the adaptive mask choice of a real layer (128 of thousands of columns).
    w, h, x = correlated_layer(64, IN, TOKENS, seed=5)
    e_sgpt = proxy_error(w, sparsegpt(w, h, SparseGPTConfig(pattern, block_size=32)).weight, h)
    e_mag = proxy_error(w, magnitude(w, MagnitudeConfig(pattern)).weight, h)
    e_wanda = proxy_error(w, wanda(w, x.norm(dim=1), WandaConfig(pattern)).weight, h)
    assert e_sgpt < 0.7 * min(e_mag, e_wanda), (e_sgpt, e_mag, e_wanda)


def test_error_stats_independent():
    w, h, x = correlated_layer(OUT, IN, TOKENS, seed=6)
    res = sparsegpt(w, h, SparseGPTConfig(NM(2, 4)))
    d = (w - res.weight).double()
    assert res.stats["error"] == pytest.approx(2 / TOKENS * float(((d @ x.double()) ** 2).sum()), rel=1e-3)
    assert 0 < res.stats["rel_error"] < 1


@pytest.mark.parametrize("pattern", [Unstructured(0.5), NM(2, 4)], ids=str)
@pytest.mark.parametrize("scheme", [None, QuantScheme(4, True, 32)], ids=str)
@pytest.mark.parametrize("case", ["plain", "dead-inputs", "damp-0.5"])
def test_error_stats_from_the_solve_are_the_proxy_error(pattern, scheme, case):
    """The figures come from the solve's scaled errors (as GPTQ's): they must equal tr((W − Ŵ) H (W − Ŵ)ᵀ) and
    tr(W H Wᵀ) in float64, with pruned and rounded columns, dead inputs (weights not zero, H's rows zero) and heavy
    damping."""
    w, h, x = correlated_layer(OUT, IN, TOKENS, seed=9)
    if case == "dead-inputs":
        x[[0, 7, 40]] = 0.0
        h = 2.0 / TOKENS * (x @ x.T)
    res = sparsegpt(w, h, SparseGPTConfig(pattern, scheme=scheme, damp=0.5 if case == "damp-0.5" else 0.01))
    d, h64, w64 = (w - res.weight).double(), h.double(), w.double()
    assert res.stats["error"] == pytest.approx(float(torch.einsum("oi,ij,oj->", d, h64, d)), rel=1e-5)
    assert res.stats["energy"] == pytest.approx(float(torch.einsum("oi,ij,oj->", w64, h64, w64)), rel=1e-6)


@pytest.mark.parametrize("pattern", [Unstructured(0.5), NM(2, 4)], ids=str)
@pytest.mark.parametrize("scheme", [QuantScheme(4, True, 32), QuantScheme(3, False, -1)], ids=str)
def test_joint_mode_kept_on_grid_pruned_zero(pattern, scheme):
    w, h, _ = correlated_layer(OUT, IN, TOKENS, seed=7)
    res = sparsegpt(w, h, SparseGPTConfig(pattern, block_size=32, scheme=scheme))
    q = res.quant
    assert q is not None and q.scheme == scheme and q.weight is res.weight
    n_groups = 1 if scheme.group_size == -1 else IN // scheme.group_size
    assert q.scale.shape == q.zero.shape == (OUT, n_groups)
    assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= scheme.max_code
    # every weight is exactly its code on its group's grid; pruned ones are exactly zero
    assert torch.equal(res.weight, dequantize(q.codes, q.scale, q.zero, scheme))
    assert (res.weight[res.pruned] == 0).all()
    check_sparsity(res.pruned, res.weight, pattern)
    # quantization errors fed back in the same pass beat pruning first and rounding afterwards
    pruned_only = sparsegpt(w, h, SparseGPTConfig(pattern, block_size=32)).weight
    e_after = proxy_error(w, torch.where(res.pruned, 0.0, fake_quantize(pruned_only, scheme)), h)
    assert res.stats["error"] < e_after, (res.stats["error"], e_after)


def test_config_and_shape_validation():
    for bad in (dict(block_size=0), dict(damp=0.0), dict(pattern=NM(2, 4), block_size=30)):
        with pytest.raises(ValueError):
            SparseGPTConfig(**{"pattern": Unstructured(0.5), **bad})
    w, h, _ = correlated_layer(4, 36, 64, seed=0)
    with pytest.raises(ValueError, match="do not match"):
        sparsegpt(w, h[:32, :32], SparseGPTConfig(Unstructured(0.5)))
    with pytest.raises(ValueError, match="does not divide"):
        sparsegpt(w, h, SparseGPTConfig(NM(4, 8)))
    with pytest.raises(ValueError, match="hessian contains NaN"):
        sparsegpt(w, h * float("nan"), SparseGPTConfig(Unstructured(0.5)))


def test_method_names_the_layer_when_statistics_are_broken():
    from compress.errors import CompressError
    from compress.engine.methods.prune import SparseGPT
    from compress.engine.statistics import Stat

    method = SparseGPT(SparseGPT.Config(pattern="2:4"))
    hessian = torch.eye(8)
    hessian[3, 3] = float("nan")
    with pytest.raises(CompressError, match=r"SparseGPT failed on model\.layers\.2\.mlp\.up_proj: hessian contains NaN"):
        method.transform_layer("model.layers.2.mlp.up_proj", torch.randn(4, 8), {Stat.HESSIAN: hessian})
