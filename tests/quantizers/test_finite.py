"""`all_finite` against the elementwise definition, including sums that overflow from finite values."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn])
@pytest.mark.parametrize("poison", [None, "nan", "inf", "-inf", "inf and -inf", "overflowing sum"])
def test_all_finite_is_the_elementwise_test(dtype, poison):
    x = torch.randn(37, 19).to(dtype)
    if poison == "overflowing sum":  # every entry finite, their float32 sum not
        big = torch.finfo(dtype).max
        x = torch.full((4, 5), big).to(dtype) if dtype != torch.float64 else torch.full((4, 5), big, dtype=dtype)
    elif poison == "inf and -inf":  # their sum is NaN
        x[3, 4], x[20, 1] = float("inf"), float("-inf")
    elif poison is not None:
        if dtype == torch.float8_e4m3fn and "inf" in poison:
            pytest.skip("float8 e4m3fn has no infinity")
        x[5, 7] = float(poison)
    assert all_finite(x) == bool(torch.isfinite(x.float() if dtype == torch.float8_e4m3fn else x).all())


def test_integers_and_empty_tensors_are_finite():
    assert all_finite(torch.arange(5)) and all_finite(torch.empty(0, 3))
