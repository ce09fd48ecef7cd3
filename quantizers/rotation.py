"""Rotations fused into a decoder's weights (QuaRot: Ashkboos et al. 2024; SpinQuant's R1 and R2: Liu et al. 2024).

The residual stream ``x [tokens, n]`` is replaced by ``x Q`` for an orthogonal ``Q [n, n]``. The function is
unchanged when every weight that touches the stream is rewritten:

- a layer reading the stream, ``y = x Wᵀ`` with ``W [out, n]``: ``W Q`` (the embeddings ``E [vocab, n]`` and the
  output layer alike: ``E Q``);
- a layer adding to it, ``W [n, in]`` and bias ``b [n]``: ``Qᵀ W`` and ``b Q``;
- an RMSNorm between them computes ``x̂ (offset + γ)`` with ``x̂ = x / rms(x)``: ``rms`` is rotation invariant,
  ``γ`` is not, so ``γ`` is first folded into the layers that read the norm (``W diag(offset + γ)``) and the norm
  keeps ``offset + γ = 1``.

R2 rotates each attention head's values by ``R [d, d]``: the value projection's rows of head ``h`` become
``Rᵀ W_h`` (a writer, per head), the output projection's columns of head ``h`` become ``W_h R`` (a reader, per
head); the attention weights mix whole heads, so the heads' outputs carry ``R`` to the output projection.

R4 rotates the down projection's input online (SpinQuant): at run time ``x -> x M`` with ``M = diag(B, …, B)``,
``B = H / √b`` for a Hadamard ``H [b, b]`` (one block, or ``n / b`` of them), and offline ``W -> W M``, so that
``(x M)(W M)ᵀ = x Wᵀ``: the layer computes the same function while its input, spread over every channel of a
block, suits a per-token activation grid.

The fused products are computed in float64 and returned in the weight's dtype. Pure functions: inputs are not modified.
"""

from __future__ import annotations

import torch


ROWS = 8192  # rows per float64 product where rows are independent: an 8B model's embeddings are 4 GB in float64


def _apply(weight: torch.Tensor, product, by_rows: bool = False) -> torch.Tensor:
    if by_rows and weight.dim() == 2 and weight.shape[0] > ROWS:
        return torch.cat([_apply(part, product) for part in weight.split(ROWS)])
    return product(weight.to(torch.float64)).to(weight.dtype)


def fold_norm(weight: torch.Tensor, gamma: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """``W [out, n] · diag(offset + γ)``: a layer reading a norm's output, the norm's scale taken in."""
    return _apply(weight, lambda w: w * (offset + gamma.to(torch.float64))[None, :], by_rows=True)


def unit_norm(gamma: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """The norm weight that scales by 1 once its scale is folded (``offset + γ = 1``)."""
    return torch.full_like(gamma, 1.0 - offset)


def rotate_reader(weight: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``W [out, n] Q``: a layer (or the embeddings) reading the rotated stream."""
    return _apply(weight, lambda w: w @ q, by_rows=True)


def rotate_writer(weight: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``Qᵀ W`` for ``W [n, in]``, or ``b Q`` for a bias ``b [n]``: a layer adding to the rotated stream."""
    return _apply(weight, lambda w: q.T @ w if w.dim() == 2 else w @ q)


def rotate_head_rows(weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """R2 on a value projection ``W [heads·d, in]`` (or its bias ``[heads·d]``): each head's rows ``Rᵀ W_h``."""
    d = r.shape[0]

    def product(w: torch.Tensor) -> torch.Tensor:
        heads = w.reshape(-1, d, *w.shape[1:])  # [heads, d, in] or [heads, d]
        out = torch.einsum("ji,hj...->hi...", r, heads)
        return out.reshape(w.shape)

    return _apply(weight, product)


def rotate_input_blocks(weight: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``W [out, n] · diag(M, …, M)`` for ``M [b, b]``, ``b`` dividing ``n``: R4 fused into a down projection."""
    return rotate_head_columns(weight, m)


def online_rotation(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x [..., n] · diag(H, …, H) / √b`` for ``H [b, b]`` (±1 entries, unnormalized), computed in ``h``'s dtype and
    returned in ``x``'s: compressed-tensors' ``HadamardTransform`` on an ``input`` (``(x H) / √b``, its rounding)."""
    b = h.shape[0]
    y = x.to(h.dtype).unflatten(-1, (-1, b)) @ h
    return (y.flatten(-2) / b ** 0.5).to(x.dtype)


def rotate_head_columns(weight: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """R2 on an output projection ``W [out, heads·d]``: each head's columns ``W_h R``."""
    d = r.shape[0]
    return _apply(weight, lambda w: (w.reshape(w.shape[0], -1, d) @ r).reshape(w.shape), by_rows=True)
