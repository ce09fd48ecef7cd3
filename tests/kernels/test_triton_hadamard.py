"""The online-rotation Triton kernel against the torch reference (compress.quantizers.rotation.online_rotation,
itself bit-equal to compressed-tensors' HadamardTransform) and a dense float64 product (interpreter, CPU; rows not
a multiple of the tile, Sylvester blocks, one Paley-Kronecker block of a width that is no power of two)."""

from __future__ import annotations

import pytest
import torch

from compress.quantizers.hadamard import random_hadamard, sylvester
from compress.quantizers.rotation import online_rotation

triton_hadamard = pytest.importorskip("compress.kernels.triton_hadamard")

CASES = {"sylvester-blocks": (96, 32), "one-sylvester": (64, 64), "random-96": (96, 96), "smallest-tile": (48, 16)}


def _matrix(b: int) -> torch.Tensor:
    return (sylvester(b) if b & (b - 1) == 0 else torch.sign(random_hadamard(b, 1))).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_computes_the_reference(case, dtype):
    n, b = CASES[case]
    h = _matrix(b)
    x = torch.randn(3, 7, n, generator=torch.Generator().manual_seed(0)).to(dtype)  # 21 rows: a partial tile
    assert triton_hadamard.supported(x, h)
    got, reference = triton_hadamard.online_rotation(x, h), online_rotation(x, h)
    assert got.dtype == dtype and got.shape == x.shape
    # ±1 products are exact: only the float32 summation order differs, then one rounding to the dtype
    tolerance = 1e-6 if dtype == torch.float32 else {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    assert torch.allclose(got.float(), reference.float(), rtol=tolerance, atol=tolerance)
    dense = x.double() @ torch.block_diag(*[h.double() / b ** 0.5] * (n // b))
    assert torch.allclose(got.double(), dense, rtol=2 * tolerance, atol=2 * tolerance)


def test_what_the_kernel_does_not_take():
    x = torch.randn(4, 48)
    assert not triton_hadamard.supported(x, _matrix(12))  # a 12-wide block: below tl.dot's 16
    assert not triton_hadamard.supported(x, _matrix(32).double())  # the scheme's precision is float32
    assert not triton_hadamard.supported(torch.randn(4, 40), _matrix(16))  # 16 does not divide 40
