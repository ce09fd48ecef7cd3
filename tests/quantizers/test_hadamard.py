"""compress.quantizers.hadamard and rotation: Hadamard matrices against scipy's and their defining property, the
per-head rotations against dense block-diagonal products."""

from __future__ import annotations

import pytest
import scipy.linalg
import torch

from compress.quantizers.hadamard import hadamard, random_hadamard, sylvester
from compress.quantizers.rotation import fold_norm, rotate_head_columns, rotate_head_rows, rotate_reader, rotate_writer


@pytest.mark.parametrize("n", [1, 2, 4, 64, 512])
def test_sylvester_is_scipys_hadamard(n):
    assert torch.equal(sylvester(n), torch.from_numpy(scipy.linalg.hadamard(n)).to(torch.float64))


# Paley I (12, 20, 44), Paley II (28, 36), and the Kronecker products of SmolLM2's, Qwen's and Llama's widths
@pytest.mark.parametrize("n", [12, 20, 28, 36, 44, 48, 576, 896, 1536, 3584])
def test_every_order_is_a_hadamard_matrix(n):
    h = hadamard(n) * n ** 0.5
    assert torch.equal(h.abs(), torch.ones_like(h))  # entries ±1
    assert torch.allclose(h @ h.T, n * torch.eye(n, dtype=torch.float64), atol=1e-9)


def test_random_hadamard_is_orthogonal_seeded_and_signed_by_row():
    a, b, c = random_hadamard(576, 0), random_hadamard(576, 0), random_hadamard(576, 1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.allclose(a @ a.T, torch.eye(576, dtype=torch.float64), atol=1e-12)
    signs = a[:, 0] / hadamard(576)[:, 0]
    assert torch.equal(a, signs[:, None] * hadamard(576)) and set(signs.tolist()) == {1.0, -1.0}


def test_random_hadamard_signs_the_inputs_as_compressed_tensors_does():
    """compressed-tensors' (SpinQuant's) ``random_hadamard_matrix`` is ``diag(s) · H``: times ``Hᵀ`` it is diagonal,
    as ours is. So seeds change the magnitudes a symmetric grid sees (the signs of a column after the mix would not)."""
    ct = pytest.importorskip("compressed_tensors.transform.utils.hadamard")
    theirs = ct.random_hadamard_matrix(64, torch.float64, gen=torch.Generator().manual_seed(0))
    ours = random_hadamard(64, 0)
    for m in (theirs, ours):
        d = m @ hadamard(64).T
        assert torch.allclose(d, torch.diag(torch.diagonal(d)), atol=1e-12)
    x = torch.randn(8, 64, dtype=torch.float64)
    assert not torch.allclose((x @ random_hadamard(64, 0)).abs(), (x @ random_hadamard(64, 1)).abs())


def test_orders_without_a_construction_are_refused():
    with pytest.raises(ValueError, match="no Hadamard matrix of order 92"):
        hadamard(92)


def test_per_head_rotations_are_block_diagonal_products():
    torch.manual_seed(0)
    r = hadamard(12)
    block = torch.block_diag(*[r] * 3)  # 3 heads of 12
    values, bias, mixer = torch.randn(36, 20), torch.randn(36), torch.randn(20, 36)
    assert torch.allclose(rotate_head_rows(values.double(), r), block.T @ values.double())
    assert torch.allclose(rotate_head_rows(bias.double(), r), bias.double() @ block)
    assert torch.allclose(rotate_head_columns(mixer.double(), r), mixer.double() @ block)


def test_a_rotated_reader_and_writer_pair_computes_the_same():
    """x → reader (norm folded) → writer: the rotated stream x Q gives the rotated output y Q."""
    torch.manual_seed(0)
    q = random_hadamard(48, 3)
    x, gamma = torch.randn(5, 48, dtype=torch.float64), torch.rand(48, dtype=torch.float64) + 0.5
    reader, writer, bias = (torch.randn(16, 48, dtype=torch.float64), torch.randn(48, 16, dtype=torch.float64),
                            torch.randn(48, dtype=torch.float64))
    y = (x * gamma) @ reader.T @ writer.T + bias
    rotated = (x @ q) @ rotate_reader(fold_norm(reader, gamma), q).T @ rotate_writer(writer, q).T + rotate_writer(bias, q)
    assert torch.allclose(rotated, y @ q, atol=1e-10)
    assert reader.dtype == torch.float64 and rotate_reader(reader.float(), q).dtype == torch.float32  # stored dtype kept


def test_long_readers_are_rotated_by_rows_alike(monkeypatch):
    import compress.quantizers.rotation as rotation

    torch.manual_seed(0)
    q, w = random_hadamard(12, 0), torch.randn(50, 12)
    whole = rotate_reader(w, q)
    monkeypatch.setattr(rotation, "ROWS", 8)
    assert torch.allclose(rotate_reader(w, q), whole, rtol=1e-6, atol=1e-7)  # float64 products, float32 results
    expected = (w.double().reshape(50, 3, 4) @ hadamard(4)).reshape(50, 12).float()
    assert torch.allclose(rotate_head_columns(w, hadamard(4)), expected, rtol=1e-6, atol=1e-7)
