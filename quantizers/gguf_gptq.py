"""GPTQ solved in a GGUF block type's own grids: the written file is the calibrated result.

Frantar et al., "GPTQ", ICLR 2023 (arXiv:2210.17323), with the quantization grid of llama.cpp's block
formats (``ggml-quants.c``) in place of GPTQ's per-group min-max grid.

Objective: as `compress.quantizers.gptq`, ``min ‖WX − QX‖² = (n/2)·tr((W − Q) H (W − Q)ᵀ)`` with
``H = 2/n·XXᵀ``, but ``Q`` must be what a GGUF type stores: per block of B consecutive columns of a row
(B = 32 for Q4_0/Q5_0/Q8_0/IQ4_NL..., 256 for the k-quants and IQ4_XS) one grid, for the k-quants a
super-block's float16 ``d``/``dmin`` with 6-bit (or 4-bit) sub-block scales and mins, and integer codes;
for IQ4_NL/IQ4_XS the codes index a non-uniform codebook (``grids.BlockGrid.levels``); the lattice types code a
group of weights by one codebook point (``grids.LatticeGrid``): IQ3_S 4 weights of a 512-point grid with free
signs, IQ2_S 8 of 1024 with free signs, IQ3_XXS 4 of 256, IQ2_XXS 8 of 256 and IQ2_XS 8 of 512 with the signs of
each 8 of even parity.

Procedure: columns are quantized in order with GPTQ's Cholesky error feedback and lazy batches (the
batch is a whole number of blocks). When a block's first column is reached, its grid is fitted by the
type's own encoder (`compress.formats.gguf.grids.fit`) to the block's columns as they are then (every
earlier error fed back), with ``diag(H)`` (each column's mean squared input, what llama.cpp's imatrix
holds) as the importance of ggml's weighted fit (``weighted_fit``) or ggml's plain fit. Each column is
then rounded to the nearest code of its grid (the nearest codebook level, for the non-uniform types),
and its error spread over the columns not yet quantized; for a lattice type the group's columns are
rounded jointly to one grid point (`_round_lattice_block`), then their errors spread column by column.
The grids and codes are packed into the type's bytes. With ``refit_scales`` (the default) each block's
float16 scale and min are then solved on the whole ``H`` with the codes kept (`compress.quantizers.gguf_refit`:
the grid of a block was fitted before the columns after it were seen). The result's weight is the decode of
the bytes.

Shapes: ``weight [out, in]`` (``in`` a multiple of B), ``hessian [in, in]``; ``data [out, row_bytes]``
uint8, the GGUF tensor's rows. The inputs are not modified; runs in float32 on the CPU (the grid fits
are numpy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from compress.formats.gguf import grids
from compress.formats.gguf.codecs import decode_tensor, round_trip
from compress.formats.gguf.lattice import parity_signs
from compress.formats.gguf.sizes import GGMLType
from compress.quantizers.gptq import check_solver_settings, energy_rows, factored_figures, lowered, proxy_loss_rows, solver_inputs
from compress.quantizers.gguf_refit import ScaleRefit, refit_scales, worth_refitting
from compress.quantizers.gptq_columns import AffineColumns, affine_steps, feed_error_, lazy_update
from compress.quantizers.hessian_factor import inverse_hessian_factor
from compress.quantizers.threads import even_runs, one_thread, one_thread_workers, share_runs

# weights (rows x the type's block) of one block column a thread's share of the rows must hold before the rows are cut
# between threads (`row_parts`): below it the interpreter's work around each block's fit and rounding, which holds its
# lock, outweighs the arithmetic. Measured on 2 cores, the loop whole on two threads (its steps split) / the loop of
# each half of the rows on a thread of its own: 3072 x 576 Q5_0 70 / 48 ms, 1536 x 576 38 / 34 ms, 1024 x 576 28 / 31
# ms, 768 x 576 22 / 28 ms; 576 x 1536 Q4_K 76 / 40 ms, Q6_K 66 / 32 ms, Q2_K 84 / 39 ms, IQ3_XXS 2.19 / 1.55 s.
SPLIT_ELEMENTS = 768 * 32


def floored_importance(diag: torch.Tensor) -> torch.Tensor:
    """Each input column's importance for ggml's weighted fit, ``diag`` (its mean square, up to a factor) with a floor
    of 1e-8 of the mean, so that no column is weightless."""
    return diag + 1e-8 * diag.mean()


@dataclass(frozen=True)
class GGUFGPTQConfig:
    kind: GGMLType
    block_size: int = 128  # lazy-batch columns, rounded up to whole blocks of the type
    damp: float = 0.01  # λ = damp · mean(diag H)
    max_damp_tries: int = 8
    weighted_fit: bool = True  # fit each block's grid with diag(H) as ggml's importance weights
    compare_rtn: bool = True  # also report ``rtn_rel_error``: ggml's own rounding of the weight (one more encode)
    refit_scales: bool = True  # then each block's float16 scale (and min) solved on the whole H, codes kept (`gguf_refit`;
    # types below 8 bits a weight)
    keep_rounded: bool = False  # also return ``rounded`` (GPTQ's columns as rounded: AutoRound's start), one more [out, in]

    def __post_init__(self) -> None:
        check_solver_settings(self.block_size, self.damp, self.max_damp_tries)
        if not grids.is_block_quantized(self.kind):
            raise ValueError(f"{self.kind.name} has no quantization grid: GPTQ needs a block-quantized type")


@dataclass
class GGUFQuantResult:
    weight: torch.Tensor  # [out, in] float32, the decode of ``data``
    data: np.ndarray  # [out, row_bytes] uint8 in ``kind``'s block layout
    kind: GGMLType
    stats: dict = field(default_factory=dict)
    # [out, in] float32, with ``keep_rounded``: GPTQ's columns as they were rounded (the error feedback of the columns before in them): an
    # affine grid's codes are their nearest
    rounded: torch.Tensor | None = None


def _round_block(W1t: torch.Tensor, Err1t: torch.Tensor, U1: torch.Tensor, b: int, grid: grids.BlockGrid,
                 compiled: AffineColumns | None = None) -> np.ndarray:
    """Round the block of columns ``b:b+B`` of the lazy batch on ``grid`` column by column, feeding each
    error into the batch's later columns. The batch is held transposed, ``W1t``/``Err1t`` ``[batch, rows]``
    (updated in place), so that each column and each error-feedback update is contiguous. Returns the
    codes ``[rows, B]``. (Refitting the grid to the values the columns had when rounded, and rounding
    again, was tried: no consistent gain, Q2_K and Q4_K got worse.) Run inside `one_thread`: small steps. ``compiled``:
    the same loop compiled for an affine grid (`compress.quantizers.gptq_columns.AffineColumns`, the same bits)."""
    step, offset = torch.from_numpy(np.ascontiguousarray(grid.step.T)), torch.from_numpy(np.ascontiguousarray(grid.offset.T))
    dead = step == 0  # every code decodes alike there (to −offset): the lowest is written
    safe_step = torch.where(dead, 1.0, step)
    bounds = None if grid.levels is None else torch.from_numpy(grids.midpoints(grid.levels))
    levels = None if grid.levels is None else torch.from_numpy(grid.levels)
    codes = torch.empty(step.shape, dtype=torch.float32 if bounds is None else torch.int64)  # [B, rows]
    deq = torch.empty_like(step[0])
    if bounds is None and compiled is not None:
        compiled(W1t, Err1t, U1, b, step, offset, safe_step, codes, grid.lo, grid.hi)
        return codes.masked_fill_(dead, grid.lo).to(torch.int32).T.numpy()
    scratch = torch.empty_like(W1t)
    pivots = U1.diagonal()[b : b + step.shape[0]].tolist()
    columns = zip(W1t[b:].unbind(0), Err1t[b:].unbind(0), U1[b:].unbind(0), step, offset, safe_step, codes)
    for c, (w, err, u, s, o, safe, code) in enumerate(columns):  # row views made once: see gptq.py's loop
        i = b + c
        if bounds is None:  # affine grid: the code is the level
            level = torch.add(w, o, out=code).div_(safe).round_().clamp_(grid.lo, grid.hi)
        else:  # codebook: the nearest level (ties up, as ggml)
            index = torch.searchsorted(bounds, (w + o) / safe, right=True)
            code.copy_(index)
            level = levels[index]
        torch.mul(s, level, out=deq).sub_(o)
        torch.sub(w, deq, out=err).div_(pivots[c])
        feed_error_(W1t[i + 1 :], u[i + 1 :], err, scratch)  # as the compiled loop: each product rounded, then subtracted
    if bounds is None:
        codes.masked_fill_(dead, grid.lo)
    else:
        codes += grid.lo
    return codes.to(torch.int32).T.numpy()


def _round_lattice_block(W1t: torch.Tensor, Err1t: torch.Tensor, U1: torch.Tensor, b: int, grid: grids.LatticeGrid):
    """`_round_block` for a lattice type: each group of ``grid.group`` columns is rounded jointly (every
    row's signs are its weights', its point the codebook entry nearest the signed ``w/step`` with each column's
    distance weighted by ``ω = 1/U_ii²``, GPTQ's weight of a column's error), then the group's columns feed their
    errors forward one by one. With parity-coupled signs the signs of each parity group are fixed when its first
    column is reached (`lattice.parity_signs` with ω as the weights, from the columns as they are then). Returns (points ``[rows, B/group]``,
    negative ``[rows, B]``)."""
    Wt, Et, U = W1t.numpy(), Err1t.numpy(), U1.numpy()  # the batch transposed, as in `_round_block`
    step, points = grid.step, grid.points
    rows, B = step.shape
    g = grid.group
    omega_all = np.float32(1) / np.square(np.diagonal(U)[b : b + B])
    chosen = np.empty((rows, B // g), dtype=np.int64)
    negative = np.empty((rows, B), dtype=bool)
    for k in range(B // g):
        lo = k * g
        cols = slice(b + lo, b + lo + g)
        w, s, omega = Wt[cols].T, step[:, lo : lo + g], omega_all[lo : lo + g]
        if not grid.parity:
            negative[:, lo : lo + g] = w < 0
        elif lo % grid.parity == 0:
            span = slice(lo, lo + grid.parity)
            w8 = Wt[b + lo : b + lo + grid.parity].T
            negative[:, span] = parity_signs(w8, np.broadcast_to(omega_all[span], w8.shape))[0]
        sign = np.where(negative[:, lo : lo + g], np.float32(-1), np.float32(1))
        magnitude = np.where(s > 0, w * sign / np.where(s > 0, s, np.float32(1)), np.float32(0))
        # Σ ω (m − p)² up to the rows' constant Σ ω m²: [rows, P]
        dist = (omega * np.square(points)).sum(axis=1)[None, :] - 2 * (magnitude * omega) @ points.T
        chosen[:, k] = dist.argmin(axis=1)
        q = (s * points[chosen[:, k]]) * sign
        for c in range(g):
            i = cols.start + c
            err = (Wt[i] - q[:, c]) / U[i, i]
            Wt[i + 1 :] -= U[i, i + 1 :, None] * err[None, :]
            Et[i] = err
    return chosen, negative


def gguf_gptq(weight: torch.Tensor, hessian: torch.Tensor, config: GGUFGPTQConfig) -> GGUFQuantResult:
    """Quantize ``weight`` into ``config.kind`` blocks with GPTQ given ``hessian``.

    ``stats``: ``error``/``rel_error``/``energy`` and by row ``error_rows``/``energy_rows`` (as
    `compress.quantizers.gptq.gptq`: from the solve's own column errors, no product by ``H`` for the error), with
    ``compare_rtn`` ``rtn_rel_error`` and by row ``rtn_error_rows`` (the type's plain encoder on the same weight, for
    comparison: one more encode and one product by ``H``), ``damp``, ``lambda``, ``damp_retries``, ``dead_columns``.
    """
    kind, B = config.kind, grids.block_size(config.kind)
    W, H = solver_inputs(weight, hessian)
    W, H = W.cpu(), H.cpu()
    cols = W.shape[1]
    if cols % B:
        raise ValueError(f"rows of {cols} values do not split into {kind.name} blocks of {B}")

    dead = torch.diagonal(H) == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    diag = torch.diagonal(H).clone()
    importance = floored_importance(diag).numpy() if config.weighted_fit else None
    row_sigma2 = W.square().mean(dim=1, keepdim=True).numpy()  # ggml's legacy types weigh by the row's

    refit = config.refit_scales and worth_refitting(kind)
    # tr(W H Wᵀ) by row, before the damping; the refit needs W·H whole, which gives it
    energy, weight_h = energy_rows(W, H, refit)
    U, damp, lam, retries = inverse_hessian_factor(H, config.damp, config.max_damp_tries)
    del H

    batch = B * math.ceil(config.block_size / B)
    undamped = hessian.detach().to(W.device, torch.float32) if refit else None  # the refit's (no copy of a CPU float32 H)
    rows = _solve_rows(W, U, kind, batch, importance, row_sigma2, undamped, weight_h, config.keep_rounded)
    figures = factored_figures(weight, rows.decoded, dead, lam, rows.err_rows, energy)
    data, Q = rows.data, rows.decoded
    if rows.refit is not None:
        data, Q = rows.refit.data, rows.refit.weight
        figures = lowered(figures, rows.refit.gain_rows)
    stats = {"damp": damp, "lambda": lam, "damp_retries": retries, "dead_columns": int(dead.sum()), **figures}
    if config.compare_rtn:
        W0 = weight.detach().cpu().float()
        rtn_rows = proxy_loss_rows(W0 - torch.from_numpy(round_trip(W0.numpy(), kind)), hessian.detach().cpu().float())
        stats["rtn_error_rows"] = rtn_rows
        stats["rtn_rel_error"] = float(rtn_rows.sum()) / stats["energy"] if stats["energy"] > 0 else 0.0
    rounded = rows.rounded.to(weight.device) if config.keep_rounded else None
    return GGUFQuantResult(Q.to(weight.device), data, kind, stats, rounded)


def row_parts(rows: int, kind: GGMLType, threads: int) -> int:
    """Threads to cut ``rows`` between, each running GPTQ's whole column loop on its rows (`_solve_rows`): up to
    ``threads``, while each share holds `SPLIT_ELEMENTS` weights of a block column. A codebook type (IQ4_NL, IQ4_XS)
    keeps one: its columns are rounded by torch operations one column at a time, which hold the interpreter's lock
    (3072 x 576 IQ4_NL: 317 ms whole, 332 ms in two shares)."""
    if grids.has_codebook(kind):
        return 1
    return max(1, min(threads, rows * grids.block_size(kind) // SPLIT_ELEMENTS))


@dataclass(frozen=True)
class _SolvedRows:
    data: np.ndarray  # [rows, row_bytes] the column loop's bytes
    err_rows: torch.Tensor  # [rows] float64 (`_solve_columns`)
    rounded: torch.Tensor | None  # [rows, in] each column's values when rounded, where kept
    decoded: torch.Tensor  # [rows, in] float32, the decode of ``data``
    refit: ScaleRefit | None  # the scales solved again on the whole H (`refit_scales`), where asked


def _solve_rows(W: torch.Tensor, U: torch.Tensor, kind: GGMLType, batch: int, importance: np.ndarray | None,
                row_sigma2: np.ndarray, hessian: torch.Tensor | None, weight_h: torch.Tensor | None,
                keep_rounded: bool) -> _SolvedRows:
    """`_solve_columns`, the decode of its bytes, and with ``hessian`` their scales refitted (`refit_scales`, ``weight_h``
    ``W·H``), with ``W``'s rows cut into runs (`row_parts`), each run's whole work on one thread of its own: given
    ``U`` and ``H`` each row's codes, grids, errors and scales depend on that row alone, so the bytes are those of
    the work over every row (tests/quantizers/test_gguf_gptq.py), and the threads meet once instead of at every step."""
    rows, cols = W.shape
    parts = row_parts(rows, kind, torch.get_num_threads())  # W is on the CPU (`gguf_gptq`)
    # each run decodes into its rows of these (no per-run copies to join: a Llama-sized layer's is ~0.2 GB)
    decoded = torch.empty(rows, cols)
    refitted = torch.empty(rows, cols) if hessian is not None else None

    def solve(a: int, b: int) -> tuple:
        data, err_rows, rounded = _solve_columns(W[a:b], U, kind, batch, importance, row_sigma2[a:b])
        decode_tensor(data, kind, cols, decoded[a:b].numpy())
        refit = None if hessian is None else refit_scales(W[a:b], hessian, data, kind, weight_h[a:b], decoded[a:b],
                                                          into=refitted[a:b])
        return data, err_rows, rounded if keep_rounded else None, refit

    if parts == 1:
        runs = [solve(0, rows)]
    else:
        with one_thread(W.device), one_thread_workers(parts - 1) as pool:  # every step inside on its run's thread alone
            runs = share_runs(pool, solve, even_runs(rows, parts))
    def joined(parts: tuple, cat):  # one run's as it is
        return parts[0] if len(parts) == 1 else cat(parts)

    data, err_rows, rounded, refits = zip(*runs)
    refit = None if hessian is None else ScaleRefit(joined(tuple(r.data for r in refits), np.concatenate), refitted,
                                                   joined(tuple(r.gain_rows for r in refits), torch.cat))
    return _SolvedRows(joined(data, np.concatenate), joined(err_rows, torch.cat),
                       joined(rounded, torch.cat) if keep_rounded else None, decoded, refit)


def _solve_columns(W: torch.Tensor, U: torch.Tensor, kind: GGMLType, batch: int, importance: np.ndarray | None,
                   row_sigma2: np.ndarray) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """GPTQ's column loop over ``W [rows, in]`` with the upper inverse factor ``U``, in lazy batches of ``batch``
    columns: the packed bytes ``[rows, row_bytes]``, ``Σ err²`` by row (float64), the damped error of each row
    (`compress.quantizers.gptq.factored_figures`), and each column's values when it was rounded ``[rows, in]`` (no
    column changes after; a lattice group's later columns take its earlier ones' feedback after the group's point). ``W`` is held transposed (a column per row, as the batch is).

    On the CPU no step runs on torch's threads: the lazy update's product is cut into runs of rows, each on a thread
    of ours (`lazy_update`), as the compiled loop and the grid fits (the encoders' threads) are. After a product on
    torch's threads, its idle OpenMP thread kept spinning on a core for a few milliseconds, waiting for its next task,
    while the fit's two threads wanted both cores (a 256-column Q4_K fit of 2048 rows: 9 ms alone, 14-18 ms after
    a product). `bench/gptq_speed.py --gguf q4_k q6_k`, 2048 x 2048, 2 cores: Q4_K 0.43-0.46 -> 0.38-0.40 s,
    Q6_K 0.41-0.43 -> 0.37-0.39 s (integer GPTQ 0.27-0.28 s)."""
    rows, cols = W.shape
    B = grids.block_size(kind)
    blocks: list[np.ndarray] = []  # packed bytes [rows, type_size] of each block column, in order
    err_rows = torch.zeros(rows, dtype=torch.float64)
    Wt = W.T.contiguous()  # [in, rows]: each batch's columns are contiguous rows, updated in place
    with affine_steps(rows, W.device) as compiled, lazy_update(W.device) as update:
        for i1 in range(0, cols, batch):
            i2 = min(i1 + batch, cols)
            W1t, U1 = Wt[i1:i2], U[i1:i2, i1:i2]  # [batch, rows]: a column per row
            with one_thread(W.device):
                Err1t = torch.zeros_like(W1t)
            for b in range(0, i2 - i1, B):
                qw = None if importance is None else np.broadcast_to(importance[i1 + b : i1 + b + B], (rows, B))
                grid = grids.fit(kind, W1t[b : b + B].T.numpy(), qw, row_sigma2)
                if isinstance(grid, grids.LatticeGrid):
                    blocks.append(grids.pack_lattice(grid, *_round_lattice_block(W1t, Err1t, U1, b, grid)))
                else:
                    with one_thread(W1t.device):
                        blocks.append(grids.pack(grid, _round_block(W1t, Err1t, U1, b, grid, compiled)))
            update(Wt[i2:], U[i1:i2, i2:].T, Err1t)  # lazy batch update of all later columns
            with one_thread(W.device):
                err_rows += Err1t.square().sum(0)  # float32 over the batch's columns, float64 across batches
    return np.concatenate(blocks, axis=1), err_rows, Wt.T
