"""Independent references shared by the tests: slow textbook versions that share no library code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.errors import CompressError


def one_line_error(fn, *args, **kwargs) -> str:
    """Call fn, require a CompressError with a one-line message, and return the message."""
    with pytest.raises(CompressError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def random_weight(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def reference_grid(w: np.ndarray, bits: int, symmetric: bool, group_size: int):
    """Textbook min-max grid in float64. Returns codes, scale, zero, dequant, and the unrounded w/s."""
    w = np.asarray(w, dtype=np.float64)
    rows, cols = w.shape
    width = cols if group_size == -1 else group_size
    n_groups = cols // width
    max_code = 2**bits - 1
    codes = np.zeros((rows, cols), dtype=np.int64)
    ratio = np.zeros((rows, cols), dtype=np.float64)
    deq = np.zeros((rows, cols), dtype=np.float64)
    scale = np.zeros((rows, n_groups), dtype=np.float64)
    zero = np.zeros((rows, n_groups), dtype=np.float64)
    for r in range(rows):
        for g in range(n_groups):
            seg = w[r, g * width : (g + 1) * width]
            if symmetric:
                s = float(np.max(np.abs(seg))) / (max_code / 2.0)
                z = float(2 ** (bits - 1))
            else:
                lo = min(float(np.min(seg)), 0.0)
                hi = max(float(np.max(seg)), 0.0)
                s = (hi - lo) / max_code
                z = float(min(max(np.rint(-lo / s), 0), max_code)) if s > 0 else 0.0
            if s == 0:
                s = 1.0
            scale[r, g] = s
            zero[r, g] = z
            for c in range(width):
                t = seg[c] / s
                q = int(min(max(np.rint(t) + z, 0), max_code))
                codes[r, g * width + c] = q
                ratio[r, g * width + c] = t
                deq[r, g * width + c] = s * (q - z)
    return codes, scale, zero, deq, ratio


def expand_groups(p: np.ndarray, cols: int) -> np.ndarray:
    return np.repeat(p, cols // p.shape[1], axis=1)


def assert_codes_match(got: np.ndarray, ref: np.ndarray, ratio: np.ndarray, symmetric: bool, bits: int):
    """Codes equal the reference except off-by-one at (near) exact .5 rounding ties.

    In the symmetric grid the group's absmax element sits exactly on the tie ±(2**bits - 1)/2 by
    construction; float32 may land it on either side. Those are counted separately; every other
    tie-induced mismatch must stay below 0.1% of the codes (plus one).
    """
    diff = got.astype(np.int64) - ref
    bad = diff != 0
    if not bad.any():
        return
    assert np.abs(diff[bad]).max() == 1, "codes differ by more than one step"
    frac = np.abs(ratio - np.floor(ratio) - 0.5)
    near_tie = frac < 1e-4
    assert near_tie[bad].all(), f"mismatching codes away from a rounding tie: {np.argwhere(bad & ~near_tie)[:5]}"
    endpoint = np.isclose(np.abs(ratio), (2**bits - 1) / 2, rtol=0, atol=1e-4) if symmetric else np.zeros_like(bad)
    other = (bad & ~endpoint).sum()
    assert other <= 1 + 0.001 * got.size, f"{other} tie mismatches out of {got.size}"


def reference_obq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int,
    damp: float = 0.01,
    act_order: bool = False,
    dtype: torch.dtype = torch.float64,
    params: tuple[torch.Tensor, torch.Tensor] | None = None,
    follow: tuple[torch.Tensor, torch.Tensor] | None = None,
    tie_tol: float = 1e-3,
) -> dict:
    """Slow textbook GPTQ/OBQ: one column at a time with the FULL inverse Hessian (no Cholesky, no blocks).

    For each column ``i`` in processing order: (at a group start, the group's min-max grid from the
    current W), ``q_i = quant(w_i)``, ``err = (w_i − q_i) / Hinv[i, i]``,
    ``W[:, i+1:] −= err ⊗ Hinv[i, i+1:]``, then eliminate ``i``: ``Hinv −= Hinv[:, i] Hinv[i, :] / Hinv[i, i]``.
    Damping ``λ = damp · mean(diag H)``; dead columns (``H_ii == 0``) get ``H_ii = 1`` and a zero weight.
    ``act_order``: process by decreasing ``diag(H)`` (stable order), every group's grid fixed up
    front from the original W. ``params`` (``scale, zero [out, n_groups]``) fixes all grids instead.

    ``follow`` = ``(codes, zero)`` of the implementation under test: wherever this reference's own
    unrounded value lies within ``tie_tol`` of a rounding tie (x.5), it takes the followed neighbour,
    so the two runs stay on the same path instead of diverging after a float-noise tie flip.
    Such taken flips are reported in ``code_flips`` / ``zero_flips``; nothing is followed elsewhere.

    Returns a dict: ``codes`` (int64), ``scale``, ``zero``, ``weight`` (dequantized), ``ratio`` (w/s
    when each weight was rounded), ``code_flips`` (bool), ``zero_flips`` (int), ``lam``; all in the
    original column order.
    """
    W = weight.detach().to(dtype).clone()
    H = hessian.detach().to(dtype).clone()
    rows, cols = W.shape
    max_code = 2**bits - 1
    width = cols if group_size == -1 else group_size
    n_groups = cols // width
    for k in range(cols):
        if H[k, k] == 0:
            H[k, k] = 1.0
            W[:, k] = 0.0

    def rnd(t, theirs):
        """round-half-even(t); at a near-tie take ``theirs`` if it is one of the two neighbours."""
        mine = torch.round(t)
        if theirs is None:
            return mine
        lo = torch.floor(t)
        near = (t - lo - 0.5).abs() < tie_tol
        take = near & ((theirs == lo) | (theirs == lo + 1))
        return torch.where(take, theirs, mine)

    follow_codes = follow_zero = None
    if follow is not None:
        follow_codes = follow[0].detach().to(W.device, dtype)
        follow_zero = follow[1].detach().to(W.device, dtype)
    zero_flips = 0

    def grid_of(seg, g):
        """Textbook min-max scale and zero point of one group ``seg [rows, width]``."""
        nonlocal zero_flips
        if symmetric:
            s = seg.abs().amax(dim=1) / (max_code / 2)
            z = torch.full_like(s, float(2 ** (bits - 1)))
        else:
            lo = seg.amin(dim=1).clamp(max=0)
            hi = seg.amax(dim=1).clamp(min=0)
            s = (hi - lo) / max_code
            t = -lo / torch.where(s > 0, s, torch.ones_like(s))
            own = torch.round(t).clamp(0, max_code)
            z = rnd(t, None if follow_zero is None else follow_zero[:, g]).clamp(0, max_code)
            zero_flips += int((z != own).sum())
        s = torch.where(s > 0, s, torch.ones_like(s))
        return s, z

    scale = torch.zeros(rows, n_groups, dtype=dtype, device=W.device)
    zero = torch.zeros(rows, n_groups, dtype=dtype, device=W.device)
    static = act_order or params is not None
    if params is not None:
        scale[:], zero[:] = params[0].to(W.device, dtype), params[1].to(W.device, dtype)
    elif act_order:
        for g in range(n_groups):
            scale[:, g], zero[:, g] = grid_of(W[:, g * width : (g + 1) * width], g)

    order = torch.arange(cols, device=W.device)
    if act_order:
        order = torch.argsort(torch.diagonal(H), descending=True, stable=True)
    W = W[:, order]
    H = H[order][:, order]
    lam = damp * float(torch.diagonal(H).mean())
    H += lam * torch.eye(cols, dtype=dtype, device=W.device)
    Hinv = torch.linalg.inv(H)

    codes = torch.zeros(rows, cols, dtype=torch.int64, device=W.device)
    deq = torch.zeros(rows, cols, dtype=dtype, device=W.device)
    ratio = torch.zeros(rows, cols, dtype=dtype, device=W.device)
    flips = torch.zeros(rows, cols, dtype=torch.bool, device=W.device)
    for i in range(cols):
        j = int(order[i])  # original column
        g = j // width
        if not static and j % width == 0:
            scale[:, g], zero[:, g] = grid_of(W[:, i : i + width], g)
        s, z = scale[:, g], zero[:, g]
        t = W[:, i] / s
        own = (torch.round(t) + z).clamp(0, max_code)
        q = (rnd(t, None if follow_codes is None else follow_codes[:, j] - z) + z).clamp(0, max_code)
        codes[:, j], ratio[:, j], flips[:, j] = q.long(), t, q != own
        deq[:, j] = s * (q - z)
        err = (W[:, i] - deq[:, j]) / Hinv[i, i]
        W[:, i + 1 :] -= torch.outer(err, Hinv[i, i + 1 :])
        Hinv -= torch.outer(Hinv[:, i], Hinv[i, :]) / Hinv[i, i]
    return {
        "codes": codes,
        "scale": scale,
        "zero": zero,
        "weight": deq,
        "ratio": ratio,
        "code_flips": flips,
        "zero_flips": zero_flips,
        "lam": lam,
    }


def correlated_layer(out_features: int, in_features: int, tokens: int, seed: int):
    """Random weight and ``H = 2/n X Xᵀ`` from correlated inputs ``X = (Z A)ᵀ`` (A: random mixing)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    z = torch.randn(tokens, in_features, generator=g)
    a = torch.randn(in_features, in_features, generator=g) / in_features**0.5
    a += torch.eye(in_features) * 0.1
    x = (z @ a).T.contiguous()  # [in, n]
    h = 2.0 / tokens * (x @ x.T)
    return w, h, x


def reference_prune_mask(scores: torch.Tensor, sparsity: float | None = None, nm: tuple[int, int] | None = None) -> torch.Tensor:
    """Brute-force pruning mask (True = pruned) by sorting in Python: per row the ``round(sparsity · in)``
    lowest scores, or per group of ``m`` consecutive columns of a row the ``m − n`` lowest."""
    s = scores.detach().double().tolist()
    rows, cols = len(s), len(s[0])
    mask = [[False] * cols for _ in range(rows)]
    for r in range(rows):
        if nm is None:
            spans = [(0, cols, int(round(sparsity * cols)))]
        else:
            n, m = nm
            spans = [(g, g + m, m - n) for g in range(0, cols, m)]
        for start, stop, k in spans:
            order = sorted(range(start, stop), key=lambda c: s[r][c])
            for c in order[:k]:
                mask[r][c] = True
    return torch.tensor(mask, dtype=torch.bool)


def reference_sparsegpt(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    block_size: int = 128,
    damp: float = 0.01,
    dtype: torch.dtype = torch.float64,
) -> dict:
    """Slow textbook SparseGPT: one column at a time with the FULL inverse Hessian (no Cholesky, no lazy blocks).

    ``Hinv = (H + λI)⁻¹``, ``λ = damp · mean(diag H)``; dead columns (``H_ii == 0``) get ``H_ii = 1`` and a
    zero weight. For each column ``i``: ``ŵ_i = 0`` where masked else ``w_i``,
    ``err = (w_i − ŵ_i) / Hinv[i, i]``, ``W[:, i+1:] −= err ⊗ Hinv[i, i+1:]``, then eliminate ``i``:
    ``Hinv −= Hinv[:, i] Hinv[i, :] / Hinv[i, i]``.
    Mask rule (the paper's reference code, whose ``W1**2 / diag(Hinv1)**2`` squares the diagonal of the
    Cholesky factor): OBS saliency ``w² / d_i`` where ``d_i = [H_F⁻¹]_ii`` is the inverse Hessian's
    diagonal entry at the moment column ``i`` is reached. Unstructured: at each start of a block of
    ``block_size`` columns, the ``round(sparsity · rows · B)`` lowest saliencies of the whole block (``d``
    found by eliminating the block's columns in a copy of ``Hinv``); N:M: at each group start, the
    ``m − n`` lowest of each row in the group. Returns ``weight``, ``pruned`` (bool), ``lam``.
    """
    W = weight.detach().to(dtype).clone()
    H = hessian.detach().to(dtype).clone()
    rows, cols = W.shape
    for k in range(cols):
        if H[k, k] == 0:
            H[k, k] = 1.0
            W[:, k] = 0.0
    lam = damp * float(torch.diagonal(H).mean())
    Hinv = torch.linalg.inv(H + lam * torch.eye(cols, dtype=dtype))
    out = torch.zeros_like(W)
    pruned = torch.zeros(rows, cols, dtype=torch.bool)
    d = torch.zeros(cols, dtype=dtype)
    for i in range(cols):
        if i % block_size == 0:  # diagonal of Hinv as each of the block's columns will be reached
            ahead = Hinv.clone()
            for k in range(i, min(i + block_size, cols)):
                d[k] = ahead[k, k]
                ahead -= torch.outer(ahead[:, k], ahead[k, :]) / ahead[k, k]
            if nm is None:
                stop = min(i + block_size, cols)
                sal = (W[:, i:stop] ** 2 / d[i:stop]).reshape(1, -1)
                pruned[:, i:stop] = reference_prune_mask(sal, sparsity=sparsity).reshape(rows, stop - i)
        if nm is not None and i % nm[1] == 0:
            sal = W[:, i : i + nm[1]] ** 2 / d[i : i + nm[1]]
            pruned[:, i : i + nm[1]] = reference_prune_mask(sal, nm=nm)
        q = torch.where(pruned[:, i], torch.zeros_like(W[:, i]), W[:, i])
        out[:, i] = q
        err = (W[:, i] - q) / Hinv[i, i]
        W[:, i + 1 :] -= torch.outer(err, Hinv[i, i + 1 :])
        Hinv -= torch.outer(Hinv[:, i], Hinv[i, :]) / Hinv[i, i]
    return {"weight": out, "pruned": pruned, "lam": lam}


def shuffled_batches(xs: list, batch: int, seed: int):
    """auto-round's IndexSampler written out: float64 mini-batches of ``batch`` samples of ``xs`` joined along dim 0,
    drawn in turn from a seeded shuffled order (``torch.randperm``), reshuffled when fewer than ``batch`` remain."""
    generator = torch.Generator().manual_seed(seed)
    order, at = [], len(xs)
    while True:
        if at + batch > len(xs):
            order, at = torch.randperm(len(xs), generator=generator).tolist(), 0
        yield torch.cat([xs[i] for i in order[at : at + batch]]).double()
        at += batch
