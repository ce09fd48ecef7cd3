"""AutoRound's learned rounding inside a GGML type's affine block grids: the GGUF file holds the learned codes.

Cheng et al., "Optimize Weight Rounding via Signed Gradient Descent for the Quantization of LLMs" (arXiv 2309.05516),
run by `compress.quantizers.autoround` (its objective, SignSGD update and best-step choice), with this module's
`GGMLRounding` as each weight's grid.

Grid: the type's own encoder fits each layer once, on the float weight (`compress.formats.gguf.grids.fit`: ggml's
reference fit, or its importance-weighted fit with each input column's mean square, the imatrix's values, as the
importance), and fixes every weight's ``step`` and ``offset`` (Q4_K: ``d·sc_j`` and ``dmin·m_j``; Q8_0: ``d`` and 0)
and the code range ``lo..hi``. Only the rounding offsets ``V`` ``[out, in]`` (in [−0.5, 0.5]) are learned:

    Q(W) = step · clamp(⌊(W + offset)/step + V⌉, lo, hi) − offset      (rounding straight-through)

(a weight whose step is 0 decodes to ``−offset`` whatever its code: it gets ``lo``). At ``V = 0`` the codes are
`BlockGrid.codes`' nearest rounding on that grid, so no steps write ``grids.pack(grid, grid.codes(w))``: ggml's
own bytes but for a rare code at a rounding boundary (ggml rounds ``x/(d·sc)`` or, for the legacy types Q4_0, Q8_0,
..., ``x·(1/d)``; the grid divides by the decoder's step: the k-quants differ in about 1 block of 800 or none, the
legacy types in a few rows of a hundred). auto-round's min/max tuning (``α``, ``β`` on each group's extremes) has no place
here: the scales are ggml's (6-bit sub-block scales and mins of a float16 super-block scale, for the k-quants),
chosen by its encoder, so ``α``, ``β`` are empty and stay so. Codebook types (IQ4_NL, IQ4_XS: non-uniform levels) and
the lattice types are not affine grids: `check_affine` refuses them.

GPTQ start (`gptq_start`; auto-round starts at the nearest rounding): GPTQ in the type's grids
(`compress.quantizers.gguf_gptq`) fits each block's grid to its columns as its error feedback has left them, and
rounds each column ``W̃`` (the weight plus that feedback) to the nearest code. The start takes GPTQ's grids (read back
from its bytes, `GGMLRounding.stored`) and ``W̃`` as the weight rounded in ``W``'s place
(`compress.quantizers.autoround`'s ``starts``): at ``V = 0`` the codes are GPTQ's, so no steps write GPTQ's bytes,
and ``V`` moves a code as far as it moves RTN's, to the next level where ``W̃`` lies within ``|V|`` of the rounding
boundary. (GPTQ's decoded weight lies on the grid, every ``W₀/step + offset/step`` an integer: with no clipping
factors to move the scales, ``V`` ∈ [−0.5, 0.5] would change no code but at a tie.)

Shapes: ``w``, ``V``, ``step``, ``offset`` and codes ``[out, in]`` (``in`` a multiple of the type's block B; the
blocks are each row's consecutive B columns, as a GGUF tensor's rows hold them); ``data [out, row_bytes]`` uint8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from compress.errors import CompressError
from compress.formats.gguf import grids
from compress.formats.gguf.codecs import CODECS, decode_tensor
from compress.formats.gguf.sizes import BLOCK_SIZES, GGMLType
from compress.quantizers.autoround_grid import Params, round_ste
from compress.quantizers.gguf_gptq import GGUFGPTQConfig, GGUFQuantResult, gguf_gptq


def is_affine(kind: GGMLType) -> bool:
    """True for the block types whose code is its level (``x = step·q − offset``): the ones `GGMLRounding` learns in."""
    codec = CODECS.get(kind)
    return hasattr(codec, "CODES") and getattr(codec, "LEVELS", None) is None and not grids.is_lattice(kind)


def check_affine(kind: GGMLType, name: str) -> None:
    if not is_affine(kind):
        raise CompressError(f"autoround learns rounding in GGML's affine grids, not {kind.name} ({name}): "
                            "export that type with --method gptq or imatrix")


@dataclass(frozen=True)
class GGMLRounding:
    """One layer's fitted `grids.BlockGrid` (blocks ``[out·in/B, B]``) and its per-weight ``step``/``offset`` as
    tensors ``[out, in]``: what `compress.quantizers.autoround.autoround` rounds that layer onto."""

    grid: grids.BlockGrid
    step: torch.Tensor  # [out, in] float32
    offset: torch.Tensor  # [out, in] float32

    @classmethod
    def fit(cls, kind: GGMLType, weight: torch.Tensor, importance: torch.Tensor | None = None) -> "GGMLRounding":
        """The type's own fit of ``weight [out, in]``; ``importance [in]`` (each input column's mean square, up to a
        factor): ggml's weighted fit, the legacy types' weighted by each row's mean square, as llama-quantize's."""
        check_affine(kind, "this layer")
        w = weight.detach().float().cpu().numpy()
        out, cols = w.shape
        B = grids.block_size(kind)
        if cols % B:
            raise ValueError(f"rows of {cols} values do not split into {kind.name} blocks of {B}")
        blocks = np.ascontiguousarray(w.reshape(-1, B))
        qw = sigma2 = None
        if importance is not None:
            imp = importance.detach().float().cpu().numpy()
            qw = np.ascontiguousarray(np.broadcast_to(imp, (out, cols)).reshape(-1, B))
            sigma2 = np.repeat(np.mean(w * w, axis=1, keepdims=True, dtype=np.float32), cols // B, axis=0)
        return cls._of(grids.fit(kind, blocks, qw, sigma2), out, cols)

    @classmethod
    def stored(cls, kind: GGMLType, data: np.ndarray) -> "GGMLRounding":
        """The grid that a layer's bytes ``data [out, row_bytes]`` in ``kind`` are written on (`grids.stored`)."""
        check_affine(kind, "this layer")
        B, size = BLOCK_SIZES[kind]
        out, cols = data.shape[0], data.shape[1] // size * B
        return cls._of(grids.stored(kind, np.ascontiguousarray(data).reshape(-1, size)), out, cols)

    @classmethod
    def _of(cls, grid: grids.BlockGrid, out: int, cols: int) -> "GGMLRounding":
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(out, cols))  # noqa: E731
        return cls(grid, as_tensor(grid.step), as_tensor(grid.offset))

    def start(self, w: torch.Tensor) -> Params:
        """``V = 0``; no clipping factors (``[out, 0]``): ggml's encoder fixed the scales."""
        empty = w.new_zeros(w.shape[0], 0)
        return Params(torch.zeros_like(w), empty, empty.clone())

    def _level(self, x: torch.Tensor, v: torch.Tensor, ste: bool) -> torch.Tensor:
        step, offset = self.step.to(x), self.offset.to(x)
        t = (x + offset) / torch.where(step == 0, torch.ones_like(step), step) + v
        return (round_ste(t) if ste else torch.round(t)).clamp(self.grid.lo, self.grid.hi)

    def qdq(self, w: torch.Tensor, p: Params, start: torch.Tensor | None = None) -> torch.Tensor:
        """``Q(W)`` ``[out, in]`` in ``w``'s dtype, differentiable in ``V`` (``start``: the weight rounded in ``w``'s place)."""
        step, offset = self.step.to(w), self.offset.to(w)
        return step * self._level(w if start is None else start, p.v, ste=True) - offset

    def codes(self, w: torch.Tensor, p: Params, start: torch.Tensor | None = None) -> np.ndarray:
        """int32 codes ``[out, in]`` of the chosen ``V``, in float32 as `BlockGrid.codes` takes them (``V = 0``: its codes)."""
        x = (w if start is None else start).detach().float().cpu()
        q = self._level(x, p.v.detach().float().cpu(), ste=False)
        return torch.where(self.step == 0, float(self.grid.lo), q).to(torch.int32).numpy()

    def finish(self, w: torch.Tensor, p: Params, start: torch.Tensor | None = None) -> GGUFQuantResult:
        """The layer's bytes ``[out, row_bytes]`` and their decode (float32, ``w``'s device), ``weight_rel_error``."""
        out, cols = w.shape
        B = grids.block_size(self.grid.kind)
        data = grids.pack(self.grid, self.codes(w, p, start).reshape(-1, B)).reshape(out, -1)
        deq = torch.from_numpy(decode_tensor(data, self.grid.kind, cols)).to(w.device)
        w32 = w.detach().float()
        rel = float(torch.linalg.vector_norm(w32 - deq) / torch.linalg.vector_norm(w32).clamp_min(1e-30))
        return GGUFQuantResult(deq, data, self.grid.kind, {"weight_rel_error": rel})


def gptq_start(weight: torch.Tensor, hessian: torch.Tensor,
               config: GGUFGPTQConfig) -> tuple[GGMLRounding, torch.Tensor]:
    """GPTQ in ``config.kind``'s grids (`compress.quantizers.gguf_gptq.gguf_gptq` of ``weight [out, in]`` on
    ``hessian [in, in]``) as the steps' start: the rounding on the grids GPTQ's bytes are written on, and the weight
    rounded in ``weight``'s place ``[out, in]`` (float32): GPTQ's columns as it rounded them. At ``V = 0`` the codes
    are GPTQ's (so its scales are not refitted after the column loop, which would move them off its codes)."""
    solved = gguf_gptq(weight, hessian, replace(config, refit_scales=False, keep_rounded=True))
    return GGMLRounding.stored(config.kind, solved.data), solved.rounded
