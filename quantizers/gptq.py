"""GPTQ: post-training quantization of one linear layer with second-order error feedback.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", ICLR 2023, arXiv:2210.17323.

Objective. For a layer ``y = W x`` with calibration inputs ``X [in, n]`` find ``Q`` on the grid (see
``grid``) minimising the layer-output error

    ‖WX − QX‖²_F = (n/2) · tr((W − Q) H (W − Q)ᵀ),    H = 2/n · X Xᵀ  [in, in].

The rows of ``W`` are independent given ``H``. GPTQ quantizes one *column* at a time (for all rows at
once) in a fixed order, and after rounding column ``i`` spreads its error over the columns not yet
quantized with the Optimal Brain Surgeon update

    W[:, F] −= (w_i − q_i) / [H_F⁻¹]_ii · [H_F⁻¹]_{i, F}

where ``H_F⁻¹`` is the inverse Hessian of the remaining columns ``F`` (``i`` is eliminated after each
step). Row ``i`` of the upper Cholesky factor ``U`` of ``H⁻¹ = UᵀU`` is exactly that eliminated row
divided by ``sqrt([H_F⁻¹]_ii)``, so the update is ``err = (w_i − q_i) / U_ii; W[:, i+1:] −= err ⊗ U[i, i+1:]``
and ``H⁻¹`` never has to be updated (Section 4, "Cholesky reformulation").

Lazy batch updates (Algorithm 1): the columns are processed in blocks of ``block_size``; the update
above is applied only within the block, the block's scaled errors ``Err [out, B]`` are collected and
the later columns are updated once per block with ``W[:, i2:] −= Err · U[i1:i2, i2:]``.

Groups (``group_size > 0``): a group's grid is computed when its first column is reached, from
the group's columns as they are at that point (all earlier errors fed back). The reference
implementation reads them from ``W`` without the current block's in-block updates; the two agree
whenever groups start at block starts (e.g. group 128 with block 128), and here the result does not
depend on ``block_size`` beyond float rounding.

Options: ``act_order`` processes the columns by decreasing ``diag(H)`` (the reference's
``desc_act``) with static groups (every group's grid fixed up front from the original ``W``);
``mse`` replaces min-max by the clipping search ``grid.mse_qparams``; ``refit_scales`` (integer grids) solves each
group's scale again on the whole ``H`` once every code is fixed (`compress.quantizers.scale_refit`: the group's grid
was fitted before the columns after it were seen).

Float grids (``float_grid``: FP8, NVFP4, MXFP4) run the same loop: each column is rounded to its group's
float elements and the error fed back is the same. NVFP4's per-tensor global scale is fixed from ``W``
before the loop (as llm-compressor's observer does), so later groups' E4M3 scales share it; an FP8 block
scale is fitted from all the block's rows when its first column is reached.

Shapes: ``weight [out, in]``, ``hessian [in, in]`` (symmetric positive semi-definite); the result's
``weight``/``codes`` are ``[out, in]``, ``scale``/``zero`` ``[out, n_groups]`` and, with act-order,
``g_idx [in]``. Everything runs in float32 on the inputs' device; the inputs are not modified. On the CPU the
column loop of an integer grid runs compiled where a C compiler is present (`gptq_columns`, the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compress.quantizers.finite import all_finite
from compress.quantizers.grid import QuantScheme, mse_qparams
from compress.quantizers.gptq_columns import column_steps
from compress.quantizers.hessian_factor import inverse_hessian_factor
from compress.quantizers.result import Grid, QuantResult
from compress.quantizers.scale_refit import held_factors, refit_factors, row_product
from compress.quantizers.threads import one_thread


@dataclass(frozen=True)
class GPTQConfig:
    """Settings of one GPTQ run; the defaults are those of the reference implementation."""

    scheme: Grid  # integer (bits / symmetric / group_size, -1 = per output channel) or float grid
    block_size: int = 128  # lazy-batch column block (Algorithm 1)
    damp: float = 0.01  # λ = damp · mean(diag H)
    act_order: bool = False  # desc_act: process columns by decreasing diag(H), static groups
    mse: bool = False  # MSE grid search for the clipping range of each group
    mse_grid: int = 100
    mse_max_shrink: float = 0.8
    mse_norm: float = 2.4
    max_damp_tries: int = 8  # retries with damp ×10 each time the Cholesky factorization fails
    refit_scales: bool = True  # after the loop, each group's scale solved on the whole H, codes kept (integer grids)

    def __post_init__(self) -> None:
        check_solver_settings(self.block_size, self.damp, self.max_damp_tries)
        if self.mse_grid < 1 or not 0 < self.mse_max_shrink <= 1:
            raise ValueError(f"bad MSE search: grid {self.mse_grid}, max_shrink {self.mse_max_shrink}")


def check_solver_settings(block_size: int, damp: float, max_damp_tries: int) -> None:
    """Validate the settings GPTQ and SparseGPT share (lazy-batch block, damping)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not damp > 0:
        raise ValueError(f"damp must be positive, got {damp}")
    if max_damp_tries < 0:
        raise ValueError(f"max_damp_tries must be >= 0, got {max_damp_tries}")


def solver_inputs(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 working copies of ``weight [out, in]`` and ``hessian [in, in]`` for a second-order solver
    (GPTQ, SparseGPT), which updates both in place; raises ``ValueError`` on mismatched or non-finite input."""
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"weight {tuple(weight.shape)} and hessian {tuple(hessian.shape)} do not match")
    W = weight.detach().to(torch.float32, copy=True)
    H = hessian.detach().to(torch.float32, copy=True)
    if not all_finite(W):
        raise ValueError("weight contains NaN or inf")
    if not all_finite(H):
        raise ValueError("hessian contains NaN or inf")
    return W, H


def gptq(weight: torch.Tensor, hessian: torch.Tensor, config: GPTQConfig) -> QuantResult:
    """Quantize ``weight [out, in]`` with GPTQ given ``hessian [in, in]`` (e.g. ``2/n · X Xᵀ``).

    ``stats``: ``damp`` (relative damping finally used) and ``lambda`` (absolute), ``damp_retries``,
    ``dead_columns`` (``H_ii == 0``: quantized to zero), ``error`` = tr((W−Q) H (W−Q)ᵀ) with the
    given ``H``, ``energy`` = tr(W H Wᵀ) and ``rel_error`` = error / energy, and those two by row (``error_rows``,
    ``energy_rows``, float64 ``[out]``: `factored_figures`). Raises ``ValueError`` on non-finite inputs,
    mismatched shapes, or a Hessian that no damping within ``max_damp_tries`` makes factorizable.
    """
    scheme = config.scheme
    W, H = solver_inputs(weight, hessian)
    out_features, in_features = W.shape
    n_groups, width = scheme.groups(in_features), scheme.group_width(in_features)

    # Dead inputs (never active in calibration): nothing to fit, quantize the column to zero.
    dead = torch.diagonal(H) == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    scheme = scheme.fit(W)  # per-tensor parameters (NVFP4's global scale) from the weight before any update

    def qparams(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if config.mse:
            return mse_qparams(w, scheme, config.mse_grid, config.mse_max_shrink, config.mse_norm)
        return scheme.qparams(w)

    if config.act_order:
        # Static groups: every group's grid from the original W in the original column order.
        scale, zero = qparams(W)
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W, H = W.index_select(1, perm), permuted_square(H, perm)
        group_of = (perm // width).tolist()  # group of the k-th processed column
    else:
        scale = W.new_empty(out_features, n_groups)
        zero = W.new_empty(out_features, n_groups)
        group_of = [j // width for j in range(in_features)]

    # tr(W H Wᵀ) by row: the dead columns of W are zero, H's permutation is W's; the refit needs W·H whole, which gives it
    refit = config.refit_scales and scheme.free_scales
    energy, weight_h = energy_rows(W, H, refit)
    U, damp, lam, retries = inverse_hessian_factor(H, config.damp, config.max_damp_tries)
    del H  # damped in place and no longer needed: free it before the column loop

    # The loop works on the transposed weight: GPTQ visits one column at a time, and a row of ``Wt [in, out]`` is
    # contiguous where a column of ``W`` is strided (each per-column operation ~1.5x faster); the values are the same.
    Wt = W.t().contiguous()
    del W
    Qt = torch.empty_like(Wt)
    rounded = torch.empty_like(Wt)  # each column's codes as the grid's `round_column` writes them (float32)
    if config.act_order:
        scale_t, zero_t = scale.t().contiguous(), zero.t().contiguous()  # [n_groups, out]: a group's row contiguous
    else:
        scale_t, zero_t = Wt.new_empty(n_groups, out_features), Wt.new_empty(n_groups, out_features)
    column = scheme.per_column()  # one column with its own grid
    err_rows = torch.zeros(out_features, dtype=torch.float64, device=Wt.device)  # Σ err² per row: the damped error
    with column_steps(column, scale_t, zero_t, Wt.device) as steps:  # compiled where it can be (gptq_columns.py)
        for i1 in range(0, in_features, config.block_size):
            i2 = min(i1 + config.block_size, in_features)
            W1 = Wt[i1:i2].clone()  # [B, out]: the block's columns
            Err1 = torch.empty_like(W1)
            groups = group_of[i1:i2]
            # the loop stops where a group starts (without act-order): its grid from its columns as they are then
            starts = [] if config.act_order else [i for i in range(i2 - i1) if (i1 + i) % width == 0]
            edges = sorted({0, *starts, i2 - i1})
            with one_thread(Wt.device):  # small per-column operations: see quantizers/threads.py
                for first, last in zip(edges, edges[1:]):
                    if first in starts:
                        s, z = qparams(columns_as_now(Wt, W1, U, Err1, i1, first, width).t())
                        scale_t[groups[first]].copy_(s[:, 0])
                        zero_t[groups[first]].copy_(z[:, 0])
                    steps(W1, Err1, U[i1:i2, i1:i2], rounded[i1:i2], Qt[i1:i2], groups, first, last)
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1)  # lazy batch update of all later columns (no temporary)
            err_rows += Err1.square().sum(0)  # float32 over the block's columns, float64 across blocks
    codes_t = column.stored_codes(rounded)
    scale, zero = scale_t.t().contiguous(), zero_t.t().contiguous()

    g_idx = None
    if config.act_order:  # the columns back in their order: rows of the transposed results
        inverse = torch.argsort(perm)
        Qt, codes_t = Qt.index_select(0, inverse), codes_t.index_select(0, inverse)
        g_idx = (torch.arange(in_features, device=Qt.device) // width).to(torch.int32)
    Q, codes = Qt.t().contiguous(), codes_t.t().contiguous()

    figures = factored_figures(weight, Q, dead, lam, err_rows, energy)
    if refit:
        if config.act_order:
            weight_h = weight_h.index_select(1, inverse)  # W·H's columns back in their order, as W's
        Q, scale, gain = refit_group_scales(weight, hessian, Q, codes, scale, zero, scheme, weight_h)
        figures = lowered(figures, gain)
    stats = {"damp": damp, "lambda": lam, "damp_retries": retries, "dead_columns": int(dead.sum()), **figures}
    return QuantResult(Q, codes, scale, zero, scheme, g_idx=g_idx, stats=stats)


def refit_group_scales(weight: torch.Tensor, hessian: torch.Tensor, Q: torch.Tensor, codes: torch.Tensor,
                       scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme,
                       weight_h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's scale solved again on the whole ``H`` with the codes and zero points kept
    (`compress.quantizers.scale_refit`; the group's decode ``s·(q − z)`` is linear in ``s``; ``weight_h``: ``W·H``
    where the caller has it). Returns the decode on
    the new scales ``[out, in]``, the scales ``[out, n_groups]`` and each row's gain ``[out]`` (float64)."""
    width = scheme.group_width(Q.shape[1])

    def hold(r0: int, r1: int, wanted: np.ndarray) -> np.ndarray:
        return held_factors(scale[r0:r1].detach().cpu().double().numpy(), wanted, np.float32)

    factors, gain = refit_factors(weight, hessian, [Q], width, hold, weight_h)
    new_scale = (scale.double() * torch.from_numpy(factors).to(scale.device)).float()
    return scheme.dequantize(codes, new_scale, zero), new_scale, gain.to(Q.device)


def lowered(figures: dict, gain_rows: torch.Tensor) -> dict:
    """`factored_figures` with each row's error lowered by ``gain_rows`` (a scale refit's exact gain)."""
    error_rows = figures["error_rows"] - gain_rows
    error, energy = float(error_rows.sum()), figures["energy"]
    return {**figures, "error": error, "rel_error": error / energy if energy > 0 else 0.0, "error_rows": error_rows}


def permuted_square(H: torch.Tensor, perm: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """``H[perm][:, perm]`` for ``H [n, n]``, a strip of ``rows`` output rows at a time: each strip's rows are gathered,
    then its columns from that strip while it is in cache, with no whole-matrix intermediate (``index_select``, 2-3x
    advanced indexing's speed; 14336 wide: 0.78 -> 0.52 s against gathering all rows, then all columns)."""
    out = torch.empty_like(H)
    for r in range(0, H.shape[0], rows):
        torch.index_select(H.index_select(0, perm[r : r + rows]), 1, perm, out=out[r : r + rows])
    return out


def columns_as_now(Wt: torch.Tensor, W1: torch.Tensor, U: torch.Tensor, Err1: torch.Tensor, i1: int, i: int, width: int) -> torch.Tensor:
    """The ``width`` columns from block column ``i`` on, as they are when it is reached (a group's grid is fitted to
    them): in-block columns from the block ``W1 [B, out]`` (starting at column ``i1`` of ``Wt [in, out]``), later ones
    from ``Wt`` with the block's pending updates (the errors ``Err1`` of its first ``i`` columns) applied. ``[width, out]``."""
    j, i2 = i1 + i, i1 + W1.shape[0]
    cols = W1[i : i + width]
    if j + width > i2:
        pending = Wt[i2 : j + width] - U[i1:j, i2 : j + width].t() @ Err1[:i]
        cols = torch.cat([cols, pending])
    return cols


def factored_figures(weight: torch.Tensor, Q: torch.Tensor, dead: torch.Tensor, lam: float, err_rows: torch.Tensor,
                     energy_rows: torch.Tensor) -> dict:
    """A second-order solver's proxy figures (GPTQ, SparseGPT) with the caller's undamped ``H``: ``error`` =
    tr((W − Q) H (W − Q)ᵀ), i.e. (2/n)‖(W − Q)X‖² for H = 2/n X Xᵀ, ``energy`` = tr(W H Wᵀ) (given by row:
    `proxy_loss_rows`, taken before the damping) and their ratio ``rel_error``. The error needs no product by ``H``:
    the scaled column errors ``E`` of the solve satisfy ``W − Q = E U`` (each column's final value is its original
    minus the errors fed back to it), so with ``H + λI = U⁻¹U⁻ᵀ`` the damped error is ``‖E‖²`` (``err_rows``: per
    row), and the undamped one that minus ``λ‖W − Q‖²`` over the live columns (a dead column's row and column of
    ``H`` are zero). Equal to the float64 definition up to float32 rounding (tests/quantizers/test_gptq.py,
    tests/pruners/test_sparsegpt.py). Also returned by row, float64 ``[out]`` (``error_rows``, ``energy_rows``):
    the rows are independent given ``H``, so the figures of any set of rows (a layer's slice, or one of several
    layers solved stacked) are their sums."""
    delta = weight.detach().float() - Q
    if dead.any():
        delta[:, dead] = 0.0
    error_rows = err_rows - lam * delta.square_().sum(1).double()
    error, energy = float(error_rows.sum()), float(energy_rows.sum())
    return {"error": error, "rel_error": error / energy if energy > 0 else 0.0, "energy": energy,
            "error_rows": error_rows, "energy_rows": energy_rows}


def proxy_loss_rows(delta: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``tr(Δ H Δᵀ)`` of each row of ``Δ [out, in]``, in float64 ``[out]``, for a symmetric ``H [in, in]``: only its
    blocks on and above the diagonal are read, ``δHδᵀ = Σ_b δ_b (H_bb δ_bᵀ + 2 H_b,>b δ_>bᵀ)``, half the work of the
    full product (an 8B model's MLP down projection, 4096 x 14336: 9.3 -> 4.6-4.9 s; it was a quarter of the layer's
    GPTQ solve). Each column block's sum in float32, the blocks' in float64."""
    n = H.shape[0]
    step = max(n, 1) if n <= 1024 else (-(-n // 8) + 127) // 128 * 128  # about 8 blocks: their products stay large
    total = torch.zeros(delta.shape[0], dtype=torch.float64, device=delta.device)
    for k in range(0, n, step):
        e = min(k + step, n)
        block = delta[:, k:e]
        products = block @ H[k:e, k:e]
        if e < n:
            products.addmm_(delta[:, e:], H[e:, k:e], alpha=2)
        total += products.mul_(block).sum(dim=1)
    return total


def energy_rows(W: torch.Tensor, H: torch.Tensor, with_product: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tr(W H Wᵀ)`` of each row (float64 ``[out]``) and, with ``with_product``, ``W·H`` ``[out, in]`` (float32), which
    a scale refit needs whole and which then gives the energy; without it, the half product of `proxy_loss_rows`."""
    if not with_product:
        return proxy_loss_rows(W, H), None
    weight_h = row_product(W, H)
    return (weight_h * W).sum(1, dtype=torch.float64), weight_h


def proxy_loss(delta: torch.Tensor, H: torch.Tensor) -> float:
    """``tr(Δ H Δᵀ)`` for ``Δ [out, in]``: summed per row, then over rows in float64, so that the figure does
    not depend on the thread count (a whole-tensor sum is split across threads and rounds differently)."""
    return float(proxy_loss_rows(delta, H).sum())


def layer_error(weight: torch.Tensor, quantized: torch.Tensor, hessian: torch.Tensor) -> tuple[float, float]:
    """GPTQ's proxy ``tr((W − Q) H (W − Q)ᵀ)`` and its ratio to ``tr(W H Wᵀ)`` (float32 inputs)."""
    return layer_errors(weight, [quantized], hessian)[0]


def layer_errors(weight: torch.Tensor, quantized: list[torch.Tensor], hessian: torch.Tensor) -> list[tuple[float, float]]:
    """`layer_error` of several quantizations of one layer, ``tr(W H Wᵀ)`` computed once (a full product)."""
    W, H = weight.float(), hessian.float()
    base = proxy_loss(W, H)
    errors = [proxy_loss(W - q.float(), H) for q in quantized]
    return [(error, error / base if base > 0 else 0.0) for error in errors]
