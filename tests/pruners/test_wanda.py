"""Tests for compress.pruners.wanda against a brute-force per-row sort of |W_ij|·‖X_j‖₂."""

from __future__ import annotations

import pytest
import torch

from compress.pruners.magnitude import MagnitudeConfig, magnitude
from compress.pruners.masks import NM, Unstructured
from compress.pruners.wanda import WandaConfig, wanda

from references import random_weight, reference_prune_mask


def layer(seed: int):
    w = random_weight((32, 64), seed=seed)
    x = random_weight((64, 200), seed=seed + 1) * torch.linspace(0.1, 5.0, 64).unsqueeze(1)  # [in, n]
    return w, x, x.norm(dim=1)


@pytest.mark.parametrize("pattern", [Unstructured(0.5), Unstructured(0.6), NM(2, 4), NM(4, 8)], ids=str)
def test_matches_brute_force(pattern):
    w, x, l2 = layer(6)
    w0, l20 = w.clone(), l2.clone()
    res = wanda(w, l2, WandaConfig(pattern))
    scores = [[abs(float(w[r, c])) * float(torch.sqrt((x[c].double() ** 2).sum())) for c in range(64)] for r in range(32)]
    nm = (pattern.n, pattern.m) if isinstance(pattern, NM) else None
    expected = reference_prune_mask(torch.tensor(scores), sparsity=None if nm else pattern.sparsity, nm=nm)
    assert torch.equal(res.pruned, expected)
    assert torch.equal(res.weight, torch.where(expected, 0.0, w))
    assert torch.equal(w, w0) and torch.equal(l2, l20)
    if nm:
        assert ((res.weight != 0).reshape(32, -1, nm[1]).sum(dim=2) == nm[0]).all()
    else:
        assert (res.pruned.sum(dim=1) == round(pattern.sparsity * 64)).all()


def test_uniform_norms_reduce_to_magnitude():
    w = random_weight((8, 32), seed=7)
    res = wanda(w, torch.full((32,), 3.0), WandaConfig(Unstructured(0.5)))
    assert torch.equal(res.pruned, magnitude(w, MagnitudeConfig(Unstructured(0.5))).pruned)


def test_bad_inputs_raise():
    w = random_weight((8, 32), seed=8)
    with pytest.raises(ValueError, match="do not match"):
        wanda(w, torch.ones(16), WandaConfig(NM(2, 4)))
    with pytest.raises(ValueError, match="NaN"):
        wanda(w, torch.full((32,), float("nan")), WandaConfig(NM(2, 4)))
