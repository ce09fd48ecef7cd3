"""Asymmetric calibration: the layer target that makes GPTQ/SparseGPT undo the error of the layers before.

Li, Yin, et al., "GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric Calibration", ICML 2025,
arXiv:2504.02692 (GPTQModel's "GPTQ v2"). Plain GPTQ fits ``Q x_q`` to ``W x_q`` on the inputs ``x_q`` the
*compressed* model feeds the layer, so every earlier layer's error passes on untouched. The asymmetric
objective fits the compressed layer to the *uncompressed* model's output, ``W x_f`` (``x_f``: the layer's
input in the original model, same tokens):

    min_Q ‖W X_f − Q X_q‖²_F,    X_f, X_q  [in, n].

Its unconstrained minimiser is ``W* = W X_f X_qᵀ (X_q X_qᵀ)⁻¹ = W + W Δ H⁻¹`` with ``H = 2/n X_q X_qᵀ`` and the
drift ``Δ = 2/n (X_f − X_q) X_qᵀ`` (``[in, in]``). The residual ``W X_f − W* X_q`` is orthogonal to the rows of
``X_q``, so for every ``Q``

    ‖W X_f − Q X_q‖² = ‖W X_f − W* X_q‖² + (n/2) tr((W* − Q) H (W* − Q)ᵀ):

the asymmetric problem is the ordinary GPTQ (or SparseGPT) problem with ``W*`` as the weight and the same
``H``. GPTAQ folds the extra term into GPTQ's column loop; solving for ``W*`` once gives the same objective
with the solvers unchanged. ``H`` is damped as the solvers damp it (``λ = damp · mean(diag H)``), which also
keeps ``W*`` near ``W`` where the calibration inputs say little; with ``X_f = X_q`` then ``W* = W``.

Shapes: ``weight [out, in]``, ``hessian``/``drift [in, in]``; returns ``W* [out, in]`` float32. Solved in
float64 on one thread (the same result whatever the thread count); the inputs are not modified.
"""

from __future__ import annotations

import torch

from compress.quantizers.gptq import solver_inputs
from compress.quantizers.threads import one_thread


def asymmetric_target(weight: torch.Tensor, hessian: torch.Tensor, drift: torch.Tensor, damp: float,
                      max_damp_tries: int = 8) -> torch.Tensor:
    """``W* = W + W Δ (H + λI)⁻¹`` (module docstring); ``damp`` multiplied by 10 up to ``max_damp_tries``
    times while ``H + λI`` cannot be factored. Raises ``ValueError`` on mismatched or non-finite inputs."""
    W, H = solver_inputs(weight, hessian)
    if drift.shape != H.shape:
        raise ValueError(f"drift {tuple(drift.shape)} does not match hessian {tuple(H.shape)}")
    if not torch.isfinite(drift).all():
        raise ValueError("drift contains NaN or inf")
    H, D = H.double(), drift.detach().double()
    diagonal = torch.diagonal(H).clone()
    diagonal[diagonal == 0] = 1.0  # dead inputs: their drift column is zero too (x_q never active)
    mean_diag = float(diagonal.mean())
    with one_thread(H.device):
        for retry in range(max_damp_tries + 1):
            torch.diagonal(H).copy_(diagonal + damp * 10**retry * mean_diag)
            factor, info = torch.linalg.cholesky_ex(H)
            if info.item() == 0:
                # (W Δ) H⁻¹ = ((H⁻¹) (W Δ)ᵀ)ᵀ, H symmetric
                correction = torch.cholesky_solve((W.double() @ D).t().contiguous(), factor).t()
                return (W.double() + correction).float()
    raise ValueError(f"hessian is not positive definite even with damp {damp * 10**max_damp_tries:g}")
