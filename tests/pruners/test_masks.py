"""Tests for compress.pruners.masks against a brute-force sort per row / per N:M group."""

from __future__ import annotations

import pytest
import torch

from compress.pruners.masks import NM, Unstructured, is_nm_sparse, prune_lowest, prune_lowest_nm, prune_lowest_per_row

from references import random_weight, reference_prune_mask


@pytest.mark.parametrize("sparsity", [0.1, 0.5, 0.7, 0.9])
def test_per_row_matches_brute_force(sparsity):
    scores = random_weight((16, 100), seed=1).abs()
    mask = prune_lowest_per_row(scores, sparsity)
    assert torch.equal(mask, reference_prune_mask(scores, sparsity=sparsity))
    assert (mask.sum(dim=1) == round(sparsity * 100)).all()  # exact in every row


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_nm_matches_brute_force(n, m):
    scores = random_weight((16, 64), seed=2).abs()
    mask = prune_lowest_nm(scores, n, m)
    assert torch.equal(mask, reference_prune_mask(scores, nm=(n, m)))
    assert ((~mask).reshape(16, -1, m).sum(dim=2) == n).all()  # exactly n kept in every group
    assert is_nm_sparse(torch.where(mask, 0.0, scores), n, m)


def test_dispatch_and_zero_sparsity():
    scores = random_weight((4, 32), seed=3)
    assert torch.equal(prune_lowest(scores, NM(2, 4)), prune_lowest_nm(scores, 2, 4))
    assert torch.equal(prune_lowest(scores, Unstructured(0.25)), prune_lowest_per_row(scores, 0.25))
    assert not prune_lowest(scores, Unstructured(0.0)).any()


def test_is_nm_sparse():
    w = torch.ones(2, 8)
    assert not is_nm_sparse(w, 2, 4)
    w[:, [0, 1, 4, 7]] = 0
    assert is_nm_sparse(w, 2, 4) and is_nm_sparse(w, 4, 8)
    w = torch.ones(2, 8)
    w[:, [1, 2, 3, 4]] = 0  # 1 and 3 non-zeros in the groups of 4, 4 in the group of 8
    assert not is_nm_sparse(w, 2, 4) and is_nm_sparse(w, 4, 8)
    assert not is_nm_sparse(torch.zeros(2, 6), 2, 4)  # 4 does not divide 6


def test_pattern_parsing_and_validation():
    assert NM.parse("2:4") == NM(2, 4) and str(NM.parse(" 4 : 8 ")) == "4:8" and NM(2, 4).sparsity == 0.5
    for bad in ("2-4", "2:", "a:b", "2:4:8"):
        with pytest.raises(ValueError):
            NM.parse(bad)
    for n, m in ((4, 4), (0, 4), (5, 4)):
        with pytest.raises(ValueError):
            NM(n, m)
    for s in (-0.1, 1.0):
        with pytest.raises(ValueError):
            Unstructured(s)
    with pytest.raises(ValueError):
        prune_lowest_nm(torch.ones(2, 6), 2, 4)
