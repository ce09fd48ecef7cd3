"""SparseGPT: one-shot pruning of one linear layer with second-order weight reconstruction.

Frantar, Alistarh, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot",
ICML 2023, arXiv:2301.00774.

Objective. For a layer ``y = W x`` with calibration inputs ``X [in, n]`` find a sparse ``Ŵ`` (mask
as the pattern asks) minimising ``‖WX − ŴX‖²_F = (n/2) · tr((W − Ŵ) H (W − Ŵ)ᵀ)``, ``H = 2/n · X Xᵀ``.

Columns are processed left to right exactly as in GPTQ (``quantizers/gptq.py``): column ``i``'s
pruned (and, in joint mode, rounded) weights leave an error that the Optimal Brain Surgeon update
spreads over the columns not yet processed, ``W[:, F] −= err ⊗ U[i, F]`` with ``err = (w_i − ŵ_i) / U_ii``
and ``U`` the upper Cholesky factor of ``H⁻¹`` (``U_ii² = [H_F⁻¹]_ii`` when ``i`` is reached). Updates
are lazy per block of ``block_size`` columns (Algorithm 1).

Mask selection (adaptive, as the paper's reference code): the OBS saliency of a weight is
``w² / [H_F⁻¹]_ii = w² / U_ii²``.

- Unstructured: at each block start, the ``round(sparsity · out · B)`` lowest saliencies of the
  whole ``[out, B]`` block (all rows together, with all earlier blocks' updates applied) are pruned.
- N:M: when column ``i`` starts a group of M, the ``M − N`` lowest saliencies of each row within
  columns ``i .. i+M−1`` (with all updates so far, in-block ones included) are pruned.

Joint mode (``scheme`` given): kept weights are also quantized on the shared grid (``grid``), with
each group's grid computed as GPTQ does (from the group's columns as they are when it is reached),
so pruning and quantization errors are both fed back in one pass (the paper's sparse + 4-bit result).
Pruned weights are exactly zero (zero maps to the zero point on every grid).

Shapes: ``weight [out, in]``, ``hessian [in, in]`` → ``PruneResult`` with ``weight``/``pruned [out, in]``
(float32) and, in joint mode, ``quant`` (codes ``[out, in]``, scale/zero ``[out, n_groups]``).
The inputs are not modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.pruners.masks import NM, Pattern, prune_lowest_nm, prune_lowest_per_row
from compress.pruners.result import PruneResult
from compress.quantizers.grid import QuantScheme, compute_qparams
from compress.quantizers.gptq import check_solver_settings, columns_as_now, factored_figures, proxy_loss_rows, solver_inputs
from compress.quantizers.gptq_columns import column_steps
from compress.quantizers.hessian_factor import inverse_hessian_factor
from compress.quantizers.result import QuantResult
from compress.quantizers.threads import one_thread


@dataclass(frozen=True)
class SparseGPTConfig:
    """Settings of one SparseGPT run; defaults are the reference implementation's."""

    pattern: Pattern  # Unstructured(sparsity) or NM(n, m)
    block_size: int = 128  # lazy-batch column block; unstructured masks are chosen per block
    damp: float = 0.01  # λ = damp · mean(diag H)
    scheme: QuantScheme | None = None  # joint mode: also quantize the kept weights
    max_damp_tries: int = 8  # retries with damp ×10 each time the Cholesky factorization fails

    def __post_init__(self) -> None:
        check_solver_settings(self.block_size, self.damp, self.max_damp_tries)
        if isinstance(self.pattern, NM) and self.block_size % self.pattern.m:
            raise ValueError(f"block_size {self.block_size} must be a multiple of the N:M group size {self.pattern.m}")


def rows_independent(config: SparseGPTConfig) -> bool:
    """Whether row slices of a layer can be pruned apart: an N:M mask is chosen in each row, the unstructured
    mask over a whole block of columns, all rows together (as the reference implementation does)."""
    return isinstance(config.pattern, NM)


def sparsegpt(weight: torch.Tensor, hessian: torch.Tensor, config: SparseGPTConfig) -> PruneResult:
    """Prune (and in joint mode quantize) ``weight [out, in]`` with SparseGPT given ``hessian [in, in]``.

    ``stats`` as GPTQ's (``damp``, ``lambda``, ``damp_retries``, ``dead_columns``, ``error`` =
    tr((W−Ŵ) H (W−Ŵ)ᵀ), ``energy``, ``rel_error``) plus ``sparsity`` (fraction of exact zeros in ``Ŵ``).
    Raises ``ValueError`` on non-finite inputs, mismatched shapes, or an unfactorizable Hessian.
    """
    W, H = solver_inputs(weight, hessian)
    out_features, in_features = W.shape
    pattern, scheme = config.pattern, config.scheme
    if isinstance(pattern, NM) and in_features % pattern.m:
        raise ValueError(f"N:M group size {pattern.m} does not divide in_features {in_features}")

    dead = torch.diagonal(H) == 0  # never active in calibration: zero weight, pruned first
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0

    if scheme is not None:
        n_groups, width = scheme.groups(in_features), scheme.group_width(in_features)
        scale_t, zero_t = W.new_empty(n_groups, out_features), W.new_empty(n_groups, out_features)  # a group's row contiguous
        column = scheme.per_column()
    else:  # no grid: the loop's scale and zero only say how many rows there are
        width, column = in_features, None
        scale_t = zero_t = W.new_zeros(1, out_features)

    energy_rows = proxy_loss_rows(W, H)  # tr(W H Wᵀ) by row, before the damping (dead columns of W are zero)
    U, damp, lam, retries = inverse_hessian_factor(H, config.damp, config.max_damp_tries)
    del H  # damped in place and no longer needed

    # Transposed, as GPTQ's loop (quantizers/gptq.py): a column of W is a contiguous row of Wt [in, out].
    Wt = W.t().contiguous()
    del W
    Qt = torch.empty_like(Wt)
    rounded = torch.empty_like(Wt) if scheme is not None else Qt  # joint mode: the grid's column codes (else unused)
    pruned_t = torch.empty_like(Wt, dtype=torch.bool)
    err_rows = torch.zeros(out_features, dtype=torch.float64, device=Wt.device)  # Σ err² per row (as GPTQ's)
    nm = pattern.m if isinstance(pattern, NM) else 0
    # GPTQ's column loop with the mask (`compress.quantizers.gptq_columns`: compiled where it can be, the same bits)
    with column_steps(column, scale_t, zero_t, Wt.device) as steps:
        for i1 in range(0, in_features, config.block_size):
            i2 = min(i1 + config.block_size, in_features)
            W1 = Wt[i1:i2].clone()  # [B, out]
            Err1 = torch.empty_like(W1)
            U1 = U[i1:i2, i1:i2]
            d2 = torch.diagonal(U1).square().unsqueeze(1)  # [B, 1]: [H_F⁻¹]_ii when column i is reached
            mask1 = pruned_t[i1:i2]
            if not nm:  # chosen over the [out, B] block in its own order (ties fall as before)
                saliency = (W1.square() / d2).t()
                mask1.copy_(prune_lowest_per_row(saliency.reshape(1, -1), pattern.sparsity).reshape(saliency.shape).t())
            groups = [(i1 + i) // width for i in range(i2 - i1)]
            # the loop stops where an N:M group starts (its mask from its columns as they are then) and, in joint
            # mode, where a grid group starts (its grid likewise, as GPTQ's)
            starts = {i for i in range(i2 - i1) if (nm and (i1 + i) % nm == 0) or (scheme is not None and (i1 + i) % width == 0)}
            edges = sorted({0, *starts, i2 - i1})
            with one_thread(Wt.device):  # small per-column operations: see quantizers/threads.py
                for first, last in zip(edges, edges[1:]):
                    j = i1 + first
                    if nm and j % nm == 0:
                        cols = slice(first, first + nm)
                        mask1[cols] = prune_lowest_nm((W1[cols].square() / d2[cols]).t(), pattern.n, pattern.m).t()
                    if scheme is not None and j % width == 0:
                        s, z = compute_qparams(columns_as_now(Wt, W1, U, Err1, i1, first, width).t(), scheme)
                        scale_t[groups[first]].copy_(s[:, 0])
                        zero_t[groups[first]].copy_(z[:, 0])
                    # a pruned weight is rounded as zero: it maps to the zero point, whose value is exactly 0
                    steps(W1, Err1, U1, rounded[i1:i2], Qt[i1:i2], groups, first, last, mask1)
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1)  # lazy batch update of all later columns (no temporary)
            err_rows += Err1.square().sum(0)
    Q, pruned = Qt.t().contiguous(), pruned_t.t().contiguous()
    if scheme is not None:
        codes, scale, zero = column.stored_codes(rounded).t().contiguous(), scale_t.t().contiguous(), zero_t.t().contiguous()

    stats = {
        "sparsity": int((Q == 0).sum()) / Q.numel(),  # exact: the slices of a layer's rows combine by their counts
        "damp": damp,
        "lambda": lam,
        "damp_retries": retries,
        "dead_columns": int(dead.sum()),
        **factored_figures(weight, Q, dead, lam, err_rows, energy_rows),  # a pruned weight's error is fed back as a rounded one's
    }
    quant = QuantResult(Q, codes, scale, zero, scheme) if scheme is not None else None
    return PruneResult(Q, pruned, quant, stats)
