"""The scale refit's core: its products give a row the same bits in any slice of rows (what row slices solved apart
on several processes need); the solve itself is tested against dense float64 solves in test_gguf_refit.py and
test_gptq.py."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.scale_refit import refit_factors, row_product


@pytest.mark.parametrize("k, n", [(32, 576), (256, 1536), (576, 576)])
def test_a_rows_product_has_the_same_bits_in_any_slice(k, n):
    g = torch.Generator().manual_seed(k)
    a, b = torch.randn(300, k, generator=g), torch.randn(k, n, generator=g)
    whole = row_product(a, b)
    for r0, r1 in [(0, 1), (40, 41), (40, 42), (41, 80), (7, 299)]:
        assert torch.equal(row_product(a[r0:r1], b), whole[r0:r1]), (r0, r1)
    saved = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            assert torch.equal(row_product(a, b), whole)
        finally:
            torch.set_num_threads(saved)


def test_blocks_that_do_not_split_the_rows_are_refused():
    w = torch.randn(4, 48)
    with pytest.raises(ValueError, match="blocks of 32"):
        refit_factors(w, torch.eye(48), [w], 32, lambda r0, r1, wanted: wanted)
