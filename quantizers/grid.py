"""The uniform integer quantization grid every quantizer shares.

A weight ``W`` of shape ``[out_features, in_features]`` is split along ``in_features`` into groups of
``group_size`` columns (``-1``: one group per row, i.e. per output channel). Each (row, group) gets a
scale ``s`` and a zero point ``z``; codes are unsigned integers ``q`` in ``[0, 2**bits - 1]`` and

    W ≈ s · (q − z)

- asymmetric: the range ``[min(w, 0), max(w, 0)]`` maps onto the full code range, ``z = round(−min / s)``.
- symmetric: ``s = max|w| / ((2**bits − 1) / 2)`` and ``z = 2**(bits − 1)``, so the signed codes
  ``q − z`` lie in ``[−2**(bits−1), 2**(bits−1) − 1]``. This is the convention of both AutoGPTQ (stored
  zero 8 for 4 bit) and compressed-tensors (signed int4 with zero point 0), so either format stores our
  codes without re-rounding.
- symmetric, full range (``full_range``): ``s = ∓max|w| / 2**(bits − 1)``, negative where the group's extreme is
  its maximum, so the extreme always lands on the code ``−2**(bits−1)`` exactly and the other side reaches
  ``(2**(bits−1) − 1)/2**(bits−1)`` of it. The step is ``2**b/(2**b − 1)`` times finer than the half-range
  grid's (1.07× at 4 bits, 1.14× at 3, 1.33× at 2): auto-round's ``int_sym`` and llama.cpp's Q4_0/Q8_0 choice.
  The same codes and zero point, so the same formats store it; only the scale's sign is new to them, and each
  decodes ``s · (q − z)`` as written.

Shapes: ``scale`` and ``zero`` are ``[out_features, n_groups]``; codes have the weight's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_BITS, MAX_BITS = 2, 8


@dataclass(frozen=True)
class QuantScheme:
    """How one layer's weight is quantized: bit width, symmetry and grouping."""

    bits: int = 4
    symmetric: bool = True
    group_size: int = 128  # -1: per output channel
    full_range: bool = False  # symmetric only: the extreme on the lowest code, the scale signed (see the module)

    def __post_init__(self) -> None:
        if self.full_range and not self.symmetric:
            raise ValueError("full_range is a symmetric grid: drop it, or drop symmetric=false")
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be between {MIN_BITS} and {MAX_BITS}, got {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 (per channel) or positive, got {self.group_size}")

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, in_features: int) -> int:
        """Number of groups along in_features; raises if the group size does not divide it."""
        if self.group_size == -1:
            return 1
        if in_features % self.group_size:
            raise ValueError(
                f"group size {self.group_size} does not divide in_features {in_features}"
            )
        return in_features // self.group_size

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    # The grid interface quantizers drive (shared with `float_grid.FloatScheme`).
    @property
    def rows_independent(self) -> bool:
        """True: each row's grid depends on that row alone, so row slices of a layer can be quantized apart."""
        return True

    @property
    def free_scales(self) -> bool:
        """True: a group's scale is stored as a float that can take any value (so GPTQ can solve it again,
        `compress.quantizers.scale_refit`)."""
        return True

    def fit(self, w: torch.Tensor) -> "QuantScheme":
        """This scheme with its per-tensor parameters fixed from ``w``: the integer grid has none."""
        return self

    def per_column(self) -> "QuantScheme":
        """The grid of one column whose ``[out, 1]`` scale and zero are already known (GPTQ's column loop)."""
        return QuantScheme(self.bits, self.symmetric, -1, self.full_range)

    def extremes(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each (row, group)'s smallest and largest weight ``[out, n_groups]``: all `qparams` reads of ``w``."""
        return group_extremes(w, self)

    def qparams(self, w: torch.Tensor, shrink: float | torch.Tensor = 1.0, extremes=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``extremes``: `extremes(w)` already taken (a clipping search tries many shrink factors on one ``w``)."""
        return compute_qparams(w, self, shrink, extremes)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return quantize(w, scale, zero, self)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return dequantize(q, scale, zero, self)

    def round_column(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, codes: torch.Tensor, deq: torch.Tensor) -> None:
        """GPTQ's column step in few operations: the codes of ``w`` (as `stored_codes` reads them back) into
        ``codes`` and their dequantized values into ``deq``; all five are float32 ``[out]``. The values are
        `quantize`'s and `dequantize`'s: symmetric codes are kept signed, ``q − z`` with ``z = 2**(bits−1)``."""
        torch.div(w, scale, out=codes).round_()
        if self.symmetric:
            half = 1 << (self.bits - 1)
            torch.mul(codes.clamp_(-half, self.max_code - half), scale, out=deq)
        else:
            codes.add_(zero).clamp_(0, self.max_code)
            torch.sub(codes, zero, out=deq).mul_(scale)

    def code_bounds(self) -> tuple[int, int, bool] | None:
        """`round_column` as the compiled column loop runs it (`compress.quantizers.gptq_columns`): the codes'
        bounds and whether the zero point is added before clamping (and subtracted to dequantize)."""
        if self.symmetric:
            half = 1 << (self.bits - 1)
            return -half, self.max_code - half, False
        return 0, self.max_code, True

    def stored_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """The int32 codes of what `round_column` wrote."""
        return (codes + (1 << (self.bits - 1)) if self.symmetric else codes).to(torch.int32)

    def rounding_error(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """``w − dequantize(quantize(w))`` (float32, ``w``'s shape) in few passes: the clipping search's inner
        loop. The zero point is an integer, so ``clamp(round(w/s) + z, 0, M) − z == clamp(round(w/s), −z, M − z)``,
        with constant bounds when symmetric (``z = 2**(bits−1)`` everywhere, see `compute_qparams`)."""
        g = _grouped(w.float(), self)
        s = scale.unsqueeze(-1)
        q = torch.div(g, s).round_()
        if self.symmetric:
            q.clamp_(-(1 << (self.bits - 1)), self.max_code - (1 << (self.bits - 1)))
        else:  # tensor bounds: maximum/minimum are faster than clamp's tensor overload
            z = zero.unsqueeze(-1)
            torch.minimum(torch.maximum(q, -z, out=q), self.max_code - z, out=q)
        return torch.sub(g, q.mul_(s), out=q).reshape(w.shape)


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """View ``[out, in]`` as ``[out, n_groups, group_width]``."""
    out_features, in_features = w.shape
    return w.reshape(out_features, scheme.groups(in_features), scheme.group_width(in_features))


def divide(t: torch.Tensor, value: float) -> torch.Tensor:
    """``t / value``, the correctly rounded float32 quotient on every device. CUDA computes ``tensor / number``
    as a product with the number's float32 reciprocal, an ulp off the quotient for divisors such as 7.5, 15, 448
    or 6; the scale of a group whose extreme is ±7.5 steps then rounds that weight the other way, and RTN w4
    g64 of SmolLM2's 8 blocks measured KLD 0.26158 on an H200 against 0.23985 here (reproduced here by
    multiplying by the reciprocal). A divisor tensor on ``t``'s device takes the true division everywhere."""
    return t / t.new_full((), value)


def group_extremes(w: torch.Tensor, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (row, group)'s smallest and largest value of ``w [out, in]``, float32 ``[out, n_groups]`` (any grid). Taken
    in ``w``'s dtype, then widened: the same values as from a float32 copy, without the copy."""
    g = _grouped(w, scheme)  # any grid: only its groups() and group_width() are read
    return g.amin(dim=-1).float(), g.amax(dim=-1).float()


def compute_qparams(
    w: torch.Tensor, scheme: QuantScheme, shrink: float | torch.Tensor = 1.0, extremes=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero point per (row, group), in float32: each ``[out, n_groups]``.

    ``shrink`` (<= 1) narrows the range before computing the scale: the clipping searches of
    GPTQ's MSE grid and AWQ use it. ``extremes``: `group_extremes` of ``w``, when already taken.
    """
    low, high = extremes if extremes is not None else group_extremes(w, scheme)
    if scheme.symmetric:
        absmax = torch.maximum(-low, high).abs_() * shrink  # max |w|, exactly (abs_: no -0 of an all-zero group)
        half = 1 << (scheme.bits - 1)
        scale = divide(absmax, half if scheme.full_range else scheme.max_code / 2)
        if scheme.full_range:  # the larger extreme (the maximum on a tie, as auto-round) onto code −half
            scale = torch.where(high >= -low, -scale, scale)
        zero = torch.full_like(scale, float(half))
    else:
        lo = low.clamp(max=0) * shrink
        hi = high.clamp(min=0) * shrink
        scale = divide(hi - lo, scheme.max_code)
        zero = torch.round(-lo / torch.where(scale > 0, scale, 1.0)).clamp(0, scheme.max_code)
    # An all-zero group: any nonzero scale reproduces it exactly (q == z).
    scale = torch.where(scale != 0, scale, torch.ones_like(scale))
    return scale, zero


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme
) -> torch.Tensor:
    """Integer codes (int32, in ``[0, max_code]``) of ``w`` on the given grid."""
    # Broadcast the [out, n_groups] parameters over the grouped view: no per-column copies.
    q = torch.round(_grouped(w.float(), scheme) / scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))
    return q.clamp_(0, scheme.max_code).to(torch.int32).reshape(w.shape)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme
) -> torch.Tensor:
    """Float32 weight ``s · (q − z)`` from codes and per-group parameters."""
    g = _grouped(q, scheme).float().sub_(zero.unsqueeze(-1)).mul_(scale.unsqueeze(-1))
    return g.reshape(q.shape)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round ``w`` to its own min-max grid and return the dequantized float32 weight."""
    scale, zero = compute_qparams(w, scheme)
    return dequantize(quantize(w, scale, zero, scheme), scale, zero, scheme)


def mse_qparams(
    w: torch.Tensor, scheme, grid: int = 100, max_shrink: float = 0.8, norm: float = 2.4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipping search for the scale and zero point per (row, group): each ``[out, n_groups]``.

    The search of GPTQ's reference ``Quantizer.find_params(mse=True)``: try the shrink factors
    ``p = 1 - i / grid`` for ``i in range(int(max_shrink * grid))`` (1, 0.99, ..., 0.21 with the
    defaults) and keep, per (row, group), the first ``p`` with the smallest ``sum |w - deq(w)|**norm``.
    The first candidate is always ``p = 1``, so the result is never worse than plain min-max. ``scheme`` is
    any grid with the `QuantScheme` interface (the float grids too, whose scales belong to one row each).

    ``|e|**norm`` is taken as ``exp(norm · log|e|)`` (4x faster than torch's ``pow`` on CPUs, within a few
    float32 ulps of it), a block of rows at a time so that the candidates' temporaries stay in cache: the
    search runs 80 candidates over the whole weight, the largest cost of GPTQ's solve. An integer grid on the CPU
    searches compiled (`compress.quantizers.clipping`), with the same rounding errors and a power within 1e-6 of
    this one: the choice differs only where two candidates' sums are within float32 noise of each other.
    """
    if getattr(scheme, "block_rows", 1) != 1:
        raise ValueError("the MSE clipping search chooses per row: it cannot keep a scale shared by a block of rows")
    w = w.float()
    extremes = scheme.extremes(w)  # raises if the group size does not divide the row
    from compress.quantizers.clipping import compiled_search  # (it imports the column loops, which import this)

    found = compiled_search(w, scheme, [1 - i / grid for i in range(max(1, int(max_shrink * grid)))], norm, extremes)
    if found is not None:
        return found
    rows = max(1, _CACHED_ELEMENTS // w.shape[1])
    best_scale, best_zero = scheme.qparams(w, extremes=extremes)
    best_err = _group_error(w, best_scale, best_zero, scheme, norm, rows)
    for i in range(1, int(max_shrink * grid)):
        scale, zero = scheme.qparams(w, shrink=1 - i / grid, extremes=extremes)
        err = _group_error(w, scale, zero, scheme, norm, rows)
        better = err < best_err  # strict: ties keep the wider range, as the reference does
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


_CACHED_ELEMENTS = 1 << 16  # float32 elements per block of rows in the search: 256 KB, well inside a core's L2


def _group_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme, norm: float, rows: int) -> torch.Tensor:
    """``sum |w - deq|**norm`` per (row, group): ``[out, n_groups]``, ``rows`` rows at a time."""
    out_features, in_features = w.shape
    errors = w.new_empty(out_features, scheme.groups(in_features))
    for r in range(0, out_features, rows):
        e = scheme.rounding_error(w[r : r + rows], scale[r : r + rows], zero[r : r + rows])
        e = e.abs_().log_().mul_(norm).exp_()  # |e| ** norm; log 0 = -inf gives exp 0
        torch.sum(e.reshape(e.shape[0], errors.shape[1], -1), dim=-1, out=errors[r : r + rows])
    return errors
