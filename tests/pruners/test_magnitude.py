"""Tests for compress.pruners.magnitude against a brute-force per-row sort."""

from __future__ import annotations

import pytest
import torch

from compress.pruners.magnitude import MagnitudeConfig, magnitude
from compress.pruners.masks import NM, Unstructured

from references import random_weight, reference_prune_mask


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.8])
def test_unstructured_matches_brute_force(sparsity):
    w = random_weight((32, 96), seed=4)
    w0 = w.clone()
    res = magnitude(w, MagnitudeConfig(Unstructured(sparsity)))
    expected = reference_prune_mask(w.abs(), sparsity=sparsity)
    assert torch.equal(res.pruned, expected) and torch.equal(w, w0)
    assert torch.equal(res.weight, torch.where(expected, 0.0, w))  # kept weights untouched
    assert (res.pruned.sum(dim=1) == round(sparsity * 96)).all()
    assert abs(res.stats["sparsity"] - sparsity) < 0.01


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
def test_nm_matches_brute_force(n, m):
    w = random_weight((32, 64), seed=5).half()
    res = magnitude(w, MagnitudeConfig(NM(n, m)))
    expected = reference_prune_mask(w.float().abs(), nm=(n, m))
    assert torch.equal(res.pruned, expected) and res.weight.dtype == torch.float32
    assert ((res.weight != 0).reshape(32, -1, m).sum(dim=2) == n).all()
