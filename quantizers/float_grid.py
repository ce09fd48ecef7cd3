"""Float quantization grids: FP8 E4M3 and FP4 E2M1 elements with the scales serving engines read.

A weight ``W [out, in]`` is split into groups of ``group_size`` columns (``-1``: the whole row) and, for
FP8 blocks, ``block_rows`` rows share each group's scale (``-1``: all rows, i.e. one scale per tensor).
Every weight is stored as an element of a small float format times its group's scale ``s``:

    W ≈ s · e,     e = RNE(clamp(W / s, −max, max)) on the format's representable values

Formats (OCP 8-bit FP spec, OCP Microscaling Formats MX v1.0 §5.3.3; NVIDIA NVFP4):

- E4M3 ("fn": bias 7, no infinities, NaN = S.1111.111, max 448, subnormals down to 2⁻⁹).
- E2M1 (bias 1, values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}).

Grids (``FloatGrid``), with their scales computed as compressed-tensors 0.20 / llm-compressor do
(``quantization/utils/helpers.calculate_qparams``, ``generate_gparam``, ``mxfp_utils.generate_mx_scales``):

- ``FP8``: ``s = absmax / 448`` in float32, per tensor, per channel or per ``block_rows × group_size`` block.
- ``NVFP4``: two levels. A float32 global scale per tensor ``g = 448 · 6 / absmax(W)`` (`fit`), and per 16
  weights an E4M3 scale ``ŝ = E4M3(g · absmax_group / 6)``; the effective scale is ``ŝ / g``. A local
  scale that rounds to 0 becomes 0.125 (compressed-tensors' FP8 eps).
- ``MXFP4``: a power of two per 32 weights (E8M0, stored as the biased exponent byte): ``absmax`` rounded to
  a power of two (up when its mantissa is ≥ 1.75, else down: compressed-tensors' ``round_to_power_2``),
  divided by 4 = 2^⌊log₂ 6⌋. (The OCP spec floors instead; we follow what llm-compressor writes.)

Codes are the formats' bit patterns (int32 holding the E4M3 byte or the E2M1 nibble, sign bit on top), so a
negative weight that rounds to zero keeps its sign (−0), as a float cast does. `scale`/`zero` are
``[out, n_groups]`` like the integer grid's (block scales repeated over their rows; ``zero`` is all zeros),
so quantizers drive either grid through the same methods (`FloatScheme.qparams`/`quantize`/`dequantize`).
Nothing here needs torch's float8 dtypes; `require_float8` is for the writers that store them.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, replace

import torch

from compress.quantizers.grid import divide, group_extremes
from compress.errors import CompressError


class FloatFormat(enum.Enum):
    """An element format: (exponent bits, mantissa bits, exponent bias, largest finite value)."""

    E4M3 = (4, 3, 7, 448.0)
    E2M1 = (2, 1, 1, 6.0)

    @property
    def exponent_bits(self) -> int:
        return self.value[0]

    @property
    def mantissa_bits(self) -> int:
        return self.value[1]

    @property
    def bias(self) -> int:
        return self.value[2]

    @property
    def max(self) -> float:
        return self.value[3]

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal value (subnormals share it)."""
        return 1 - self.bias


class FloatGrid(str, enum.Enum):
    FP8 = "fp8"  # E4M3 elements, float32 scales
    NVFP4 = "nvfp4"  # E2M1 elements, E4M3 scale per 16 + float32 global scale
    MXFP4 = "mxfp4"  # E2M1 elements, E8M0 (power-of-two) scale per 32

    @property
    def element(self) -> FloatFormat:
        return FloatFormat.E4M3 if self is FloatGrid.FP8 else FloatFormat.E2M1

    @property
    def required_group_size(self) -> int | None:
        """The group size the format fixes (None: free)."""
        return {FloatGrid.NVFP4: 16, FloatGrid.MXFP4: 32}.get(self)


NVFP4_SCALE_EPS = 0.125  # compressed-tensors' replacement for an E4M3 scale that rounded to 0
MX_EXPONENT_OFFSET = 2  # floor(log2(6)): the E2M1 max's exponent
E8M0_BIAS = 127


@dataclass(frozen=True)
class FloatScheme:
    """How one layer's weight sits on a float grid. ``global_scale`` is NVFP4's per-tensor float32 scale,
    fixed from the whole weight by `fit` before any group is fitted (None until then)."""

    grid: FloatGrid = FloatGrid.FP8
    group_size: int = -1  # columns per scale; -1: the whole row
    block_rows: int = 1  # rows per scale (FP8 only); -1: all rows (with group_size -1: per tensor)
    global_scale: float | None = None
    column: bool = False  # a one-column view whose scales are already fitted (GPTQ's loop): no group rule

    def __post_init__(self) -> None:
        need = self.grid.required_group_size
        if need is not None and self.group_size != need and not self.column:
            raise ValueError(f"{self.grid.value} has one scale per {need} weights: group_size must be {need}, got {self.group_size}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 (whole row) or positive, got {self.group_size}")
        if self.block_rows != 1 and (self.grid is not FloatGrid.FP8 or self.block_rows < -1 or self.block_rows == 0):
            raise ValueError(f"block_rows must be 1 for {self.grid.value}, and -1 or positive for fp8, got {self.block_rows}")
        if self.block_rows == -1 and self.group_size != -1:
            raise ValueError("one scale for all rows (block_rows -1) is a per-tensor scale: it needs group_size -1")

    # -- the interface shared with the integer `QuantScheme` -----------------------------------------
    @property
    def bits(self) -> int:
        return self.grid.element.bits

    @property
    def symmetric(self) -> bool:
        return True

    def groups(self, in_features: int) -> int:
        if self.group_size == -1:
            return 1
        if in_features % self.group_size:
            raise ValueError(f"group size {self.group_size} does not divide in_features {in_features}")
        return in_features // self.group_size

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    @property
    def rows_independent(self) -> bool:
        """True: each row's grid depends on that row alone (no scale shared by a block of rows, no per-tensor
        scale still to fit from the whole weight), so row slices of a layer can be quantized apart."""
        return self.block_rows == 1 and (self.grid is not FloatGrid.NVFP4 or self.global_scale is not None)

    @property
    def free_scales(self) -> bool:
        """False: FP4's group scales are E4M3 or powers of two, too coarse for a solved factor of a few percent (FP8's
        float scales are not tried)."""
        return False

    def fit(self, w: torch.Tensor) -> "FloatScheme":
        """This scheme with its per-tensor parameters fixed from ``w`` (NVFP4's global scale; kept if set)."""
        if self.grid is not FloatGrid.NVFP4 or self.global_scale is not None:
            return self
        return replace(self, global_scale=nvfp4_global_scale(w))

    def per_column(self) -> "FloatScheme":
        """The grid of one column whose ``[out, 1]`` scale is already known (GPTQ's column loop)."""
        return replace(self, group_size=-1, block_rows=1, column=True)

    def extremes(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each (row, group)'s smallest and largest weight ``[out, n_groups]``: all `qparams` reads of ``w``."""
        return group_extremes(w, self)

    def qparams(self, w: torch.Tensor, shrink: float | torch.Tensor = 1.0, extremes=None) -> tuple[torch.Tensor, torch.Tensor]:
        return compute_qparams(w, self, shrink, extremes)

    def quantize(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return quantize(w, scale, zero, self)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return dequantize(codes, scale, zero, self)

    def round_column(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, codes: torch.Tensor, deq: torch.Tensor) -> None:
        """GPTQ's column step (the integer grid's interface): the bit patterns of ``w`` into ``codes`` and their
        values into ``deq``; all five are float32 ``[out]``."""
        bits = self.quantize(w.view(-1, 1), scale.view(-1, 1), zero.view(-1, 1))
        codes.copy_(bits.view(-1))
        deq.copy_(self.dequantize(bits, scale.view(-1, 1), zero.view(-1, 1)).view(-1))

    def code_bounds(self) -> None:
        """None: a float grid's column step has no compiled loop (`compress.quantizers.gptq_columns`)."""
        return None

    def stored_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """The int32 bit patterns of what `round_column` wrote."""
        return codes.to(torch.int32)

    def rounding_error(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """``w − dequantize(quantize(w))`` (float32): the clipping search's inner loop."""
        return w.float() - self.dequantize(self.quantize(w, scale, zero), scale, zero)


def require_float8() -> None:
    """`CompressError` unless this torch has the float8 dtypes the float formats are stored in."""
    if not hasattr(torch, "float8_e4m3fn"):
        raise CompressError(
            f"FP8/FP4 formats need torch's float8_e4m3fn dtype, which torch {torch.__version__} lacks: install torch >= 2.1"
        )


# -- element formats ---------------------------------------------------------------------------------
def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly ``2.0 ** exponent`` (int tensor in [-126, 127]) as float32, built from the exponent bits."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """⌊log₂ a⌋ for positive finite float32 ``a`` (frexp: a = m · 2^e with m in [0.5, 1))."""
    return torch.frexp(a)[1] - 1


def _steps(a: torch.Tensor, fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``a = |x|`` (float32): the binade exponent ``e`` (at least the smallest normal one; int32) and
    ``a / 2^(e − mantissa_bits)`` rounded half to even. In that binade the representable values are the
    multiples of ``2^(e − mantissa_bits)``; dividing by a power of two is exact, and ``torch.round`` rounds
    half to even, which is the even mantissa. A value rounding up to the next binade is still a multiple."""
    exponent = _floor_log2(a).clamp_(min=fmt.min_exponent, max=127 + fmt.mantissa_bits)
    exponent.masked_fill_(a == 0, fmt.min_exponent)  # frexp puts 0 in binade -1
    return exponent, torch.round(a / pow2(exponent - fmt.mantissa_bits))


def round_to_format(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest value of ``fmt``, ties to even mantissa, saturating at ±max."""
    x = x.float()
    exponent, steps = _steps(x.abs(), fmt)
    rounded = torch.clamp(steps * pow2(exponent - fmt.mantissa_bits), max=fmt.max)
    return torch.copysign(rounded, x)


def round_to_codes(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The bit patterns (int32) of ``round_to_format(x, fmt)``, computed directly: with ``e`` the binade and
    ``steps`` the rounded multiple of its quantum, the magnitude's code is ``steps + (e + bias − 1) · 2^M``
    (a subnormal's ``e`` is the smallest normal exponent, whose term is 0; a carry into the next binade
    lands on its code), saturated at the largest finite code; the sign bit goes on top."""
    x = x.float()
    exponent, steps = _steps(x.abs(), fmt)
    magnitude = steps.add_((exponent + (fmt.bias - 1)).float().mul_(float(1 << fmt.mantissa_bits)))
    magnitude.clamp_(max=float(_max_code(fmt))).add_(torch.signbit(x).float().mul_(float(1 << (fmt.bits - 1))))
    return magnitude.to(torch.int32)


def encode(values: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Bit patterns (int32) of ``values``, which must already lie on ``fmt`` (see `round_to_format`)."""
    a = values.abs()
    exponent = _floor_log2(a).clamp(min=fmt.min_exponent)
    normal = a >= 2.0**fmt.min_exponent
    significand = (a / pow2(exponent - fmt.mantissa_bits)).to(torch.int32)  # 1.m · 2^M (normal) or 0.m · 2^M
    mantissa = significand - torch.where(normal, 1 << fmt.mantissa_bits, 0).to(torch.int32)
    field = torch.where(normal, exponent + fmt.bias, 0).to(torch.int32)
    sign = torch.signbit(values).to(torch.int32)
    return (sign << (fmt.exponent_bits + fmt.mantissa_bits)) | (field << fmt.mantissa_bits) | mantissa


@functools.lru_cache(maxsize=None)
def _max_code(fmt: FloatFormat) -> int:
    """The code of the largest finite value (E4M3 0x7E, E2M1 0x7)."""
    return int(encode(torch.tensor(fmt.max), fmt))


@functools.lru_cache(maxsize=None)
def _value_table(fmt: FloatFormat) -> tuple[float, ...]:
    """The value of every bit pattern of ``fmt`` (E4M3's S.1111.111 is NaN)."""
    values = []
    for code in range(1 << fmt.bits):
        sign = -1.0 if code >> (fmt.bits - 1) else 1.0
        field = (code >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
        mantissa = code & ((1 << fmt.mantissa_bits) - 1)
        if fmt is FloatFormat.E4M3 and field == 15 and mantissa == 7:
            values.append(float("nan"))
        elif field == 0:
            values.append(sign * mantissa / (1 << fmt.mantissa_bits) * 2.0**fmt.min_exponent)
        else:
            values.append(sign * (1 + mantissa / (1 << fmt.mantissa_bits)) * 2.0 ** (field - fmt.bias))
    return tuple(values)


@functools.lru_cache(maxsize=None)
def _table_tensor(fmt: FloatFormat, device: str) -> torch.Tensor:
    return torch.tensor(_value_table(fmt), dtype=torch.float32, device=device)


def decode(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Float32 values of the bit patterns ``codes`` (any integer dtype)."""
    return _table_tensor(fmt, str(codes.device))[codes.long()]


# -- scales ------------------------------------------------------------------------------------------
def nvfp4_global_scale(w: torch.Tensor) -> float:
    """NVFP4's per-tensor scale ``448 · 6 / absmax(w)``, float32 (compressed-tensors' ``generate_gparam``)."""
    absmax = torch.clamp(w.detach().float().abs().amax(), min=torch.finfo(torch.float32).tiny)
    g = torch.nan_to_num(FloatFormat.E4M3.max * FloatFormat.E2M1.max / absmax.reshape(1), nan=1.0, posinf=1.0, neginf=1.0)
    return float(g)


def mx_exponent(absmax: torch.Tensor) -> torch.Tensor:
    """The power-of-two exponent (int32, in [-127, 127]) of each MXFP4 group's scale from its absmax."""
    a = absmax.float()
    m, e = torch.frexp(a)  # a = m · 2^e, m in [0.5, 1): a mantissa 2m ≥ 1.75 rounds up
    rounded = (e - 1) + (m >= 0.875).to(torch.int32)
    exponent = torch.where(a > 0, rounded - MX_EXPONENT_OFFSET, -E8M0_BIAS)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def mx_scale(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly ``2^exponent`` as float32 for exponents in [-127, 127] (2⁻¹²⁷ is subnormal: 2⁻¹²⁶ halved)."""
    subnormal = exponent < -126
    return pow2(torch.clamp(exponent, min=-126)) * torch.where(subnormal, 0.5, 1.0)


def _grouped(w: torch.Tensor, scheme: FloatScheme) -> torch.Tensor:
    out_features, in_features = w.shape
    return w.reshape(out_features, scheme.groups(in_features), scheme.group_width(in_features))


def _share_rows(values: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Each row block's maximum of ``values [out, G]``, repeated over its rows (the last block may be short)."""
    if block_rows == 1:
        return values
    rows = values.shape[0]
    size = rows if block_rows == -1 else block_rows
    blocks = -(-rows // size)
    padded = torch.nn.functional.pad(values, (0, 0, 0, blocks * size - rows))  # absmax >= 0: zero padding is neutral
    block_max = padded.reshape(blocks, size, -1).amax(dim=1)
    return block_max.repeat_interleave(size, dim=0)[:rows]


def _global_tensor(scheme: FloatScheme, device) -> torch.Tensor:
    if scheme.global_scale is None:
        raise ValueError("the NVFP4 grid has no global scale yet: fit the scheme to the weight first")
    return torch.tensor([scheme.global_scale], dtype=torch.float32, device=device)


def effective_scale(scale: torch.Tensor, scheme: FloatScheme) -> torch.Tensor:
    """The scale the elements are multiplied by: NVFP4's ``ŝ / g`` (compressed-tensors' order), else ``scale``."""
    if scheme.grid is FloatGrid.NVFP4:
        return scale / _global_tensor(scheme, scale.device)
    return scale


def compute_qparams(
    w: torch.Tensor, scheme: FloatScheme, shrink: float | torch.Tensor = 1.0, extremes=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale per (row, group) as stored (float32 values; NVFP4: the E4M3 local scale) and zeros: ``[out, n_groups]``.

    ``shrink`` (<= 1) narrows each group's range first (clipping searches); ``extremes``: `group_extremes(w)`."""
    low, high = extremes if extremes is not None else group_extremes(w, scheme)
    absmax = _share_rows(torch.maximum(-low, high).abs_() * shrink, scheme.block_rows)  # max |w| (abs_: no -0)
    if scheme.grid is FloatGrid.FP8:
        scale = divide(absmax, FloatFormat.E4M3.max)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any scale is exact
    elif scheme.grid is FloatGrid.NVFP4:
        local = _global_tensor(scheme, absmax.device) * divide(absmax, FloatFormat.E2M1.max)
        scale = round_to_format(local, FloatFormat.E4M3)
        scale = torch.where(scale == 0, torch.full_like(scale, NVFP4_SCALE_EPS), scale)
    else:
        scale = mx_scale(mx_exponent(absmax))
    return scale, torch.zeros_like(scale)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: FloatScheme) -> torch.Tensor:
    """Bit patterns (int32) of ``w`` on the grid of the given ``[out, n_groups]`` scales (``zero`` unused)."""
    ratio = _grouped(w.float(), scheme) / effective_scale(scale, scheme).unsqueeze(-1)
    return round_to_codes(ratio, scheme.grid.element).reshape(w.shape)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: FloatScheme) -> torch.Tensor:
    """Float32 weight ``element · scale`` from bit patterns and per-group scales."""
    values = _grouped(decode(codes, scheme.grid.element), scheme)
    return (values * effective_scale(scale, scheme).unsqueeze(-1)).reshape(codes.shape)
