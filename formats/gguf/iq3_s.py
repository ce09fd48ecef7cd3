"""IQ3_S: super-blocks of 256 weights in 8 blocks of 32, magnitudes from a 512-point grid in 4-D, free signs (3.4375 bpw).

Layout (``block_iq3_s``, ggml ``ggml-common.h``): ``d`` (f16), ``qs[64]`` (low 8 bits of each group of 4's grid
index), ``qh[8]`` (bit 8 of group g's index: bit g mod 8 of ``qh[g // 8]``), ``signs[32]`` (bit i of ``signs[k]``:
element 8k + i is negative), ``scales[4]`` (block j's 4-bit scale in nibble j mod 2 of byte j/2).
``x = d·(1 + 2·sc_j)·GRID[index][i]·(±1)``, ``GRID`` 512 points with odd coordinates 1..15 (`tables`).

Encoding follows ggml's ``quantize_iq3_s`` (``quantize_row_iq3_s_impl``, block size 32; llama.cpp does not
require an imatrix for IQ3_S). Per block, on |x| with error weights x² (with an importance matrix
``qw·sqrt(σ² + x²)``, σ² = 2·mean(x²) over the super-block): 19 trial inverse scales ``(15 + 0.2·t)/max``
(t in −9..9); each rounds every |x| to a level l in 0..7 (the value 2l + 1), and a group of 4 whose levels
are not a grid point takes the nearest of that point's precomputed grid neighbours (``iq3xs_init_impl``:
the points at the 3 smallest squared distances), distance weighted by ``sqrt(weight)``; the scale kept is
the weighted least-squares fit of the best trial. If any group was off the grid, the groups are re-snapped
at the fitted scale and the scale refitted. The block scales become ``d = max/31`` (stored ×1.033) and
4-bit ``round((s/d − 1)/2)``. A block whose |x| are all 0 writes no grid bytes and ggml does not advance
its ``qs``/``signs`` pointers, so the next blocks' bytes land one slot early: ``pack`` reproduces that.
Sums run left to right in float32 as ggml's loops do. Shapes: blocks ``[N, 256]`` <-> ``[N, 110]`` uint8.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from compress.formats.gguf._common import F32, _running_sum, fp16_bytes, fp16_field, fp16_round, nearest_int, safe_reciprocal
from compress.formats.gguf.iq4_nl import error_weights
from compress.formats.gguf.sizes import QK_K, GGMLType

KIND = GGMLType.IQ3_S
SUB = 32  # weights per block scale
GROUP = 4  # weights per grid point
N_WANT = 3  # neighbour lists hold the grid points at the 3 smallest distances
_BUCKETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 240)  # off-grid groups are searched in batches of similar neighbour counts

# ggml's kgrid_512 (ggml/src/ggml-quants.c, iq3xs_init_impl): point k has level (kgrid[k] >> 3i) & 7 in
# coordinate i, i.e. the value 2·level + 1; ggml-common.h's iq3s_grid and gguf-py's IQ3_S.grid_hex hold
# the same 512 points.
_KGRID_512 = (
       0,    1,    2,    5,    7,    8,    9,   10,   12,   14,   16,   17,   21,   27,   32,   34,
      37,   39,   41,   43,   48,   50,   57,   60,   63,   64,   65,   66,   68,   72,   73,   77,
      80,   83,   87,   89,   93,  100,  113,  117,  122,  128,  129,  133,  135,  136,  139,  142,
     145,  149,  152,  156,  162,  165,  167,  169,  171,  184,  187,  195,  201,  205,  208,  210,
     217,  219,  222,  228,  232,  234,  247,  249,  253,  256,  267,  271,  273,  276,  282,  288,
     291,  297,  312,  322,  324,  336,  338,  342,  347,  353,  357,  359,  374,  379,  390,  393,
     395,  409,  426,  441,  448,  450,  452,  464,  466,  470,  475,  488,  492,  512,  513,  514,
     516,  520,  521,  523,  525,  527,  528,  530,  537,  540,  542,  556,  558,  561,  570,  576,
     577,  579,  582,  584,  588,  593,  600,  603,  609,  616,  618,  632,  638,  640,  650,  653,
     655,  656,  660,  666,  672,  675,  685,  688,  698,  705,  708,  711,  712,  715,  721,  727,
     728,  732,  737,  754,  760,  771,  773,  778,  780,  793,  795,  802,  806,  808,  812,  833,
     840,  843,  849,  856,  858,  873,  912,  916,  919,  932,  934,  961,  963,  968,  970,  977,
     989,  993, 1010, 1016, 1024, 1025, 1027, 1029, 1031, 1032, 1034, 1036, 1038, 1041, 1043, 1047,
    1048, 1050, 1057, 1059, 1061, 1064, 1066, 1079, 1080, 1083, 1085, 1088, 1090, 1096, 1099, 1103,
    1106, 1109, 1113, 1116, 1122, 1129, 1153, 1156, 1159, 1169, 1171, 1176, 1183, 1185, 1195, 1199,
    1209, 1212, 1216, 1218, 1221, 1225, 1234, 1236, 1241, 1243, 1250, 1256, 1270, 1281, 1287, 1296,
    1299, 1306, 1309, 1313, 1338, 1341, 1348, 1353, 1362, 1375, 1376, 1387, 1400, 1408, 1410, 1415,
    1425, 1453, 1457, 1477, 1481, 1494, 1496, 1507, 1512, 1538, 1545, 1547, 1549, 1551, 1554, 1561,
    1563, 1565, 1570, 1572, 1575, 1577, 1587, 1593, 1601, 1603, 1605, 1612, 1617, 1619, 1632, 1648,
    1658, 1662, 1664, 1674, 1680, 1690, 1692, 1704, 1729, 1736, 1740, 1745, 1747, 1751, 1752, 1761,
    1763, 1767, 1773, 1787, 1795, 1801, 1806, 1810, 1817, 1834, 1840, 1844, 1857, 1864, 1866, 1877,
    1882, 1892, 1902, 1915, 1934, 1953, 1985, 1987, 2000, 2002, 2013, 2048, 2052, 2058, 2064, 2068,
    2071, 2074, 2081, 2088, 2104, 2114, 2119, 2121, 2123, 2130, 2136, 2141, 2147, 2153, 2157, 2177,
    2179, 2184, 2189, 2193, 2203, 2208, 2223, 2226, 2232, 2244, 2249, 2251, 2256, 2258, 2265, 2269,
    2304, 2306, 2324, 2335, 2336, 2361, 2373, 2375, 2385, 2418, 2443, 2460, 2480, 2504, 2509, 2520,
    2531, 2537, 2562, 2568, 2572, 2578, 2592, 2596, 2599, 2602, 2614, 2620, 2625, 2627, 2629, 2634,
    2641, 2650, 2682, 2688, 2697, 2707, 2712, 2718, 2731, 2754, 2759, 2760, 2775, 2788, 2793, 2805,
    2811, 2817, 2820, 2832, 2842, 2854, 2890, 2902, 2921, 2923, 2978, 3010, 3012, 3026, 3081, 3083,
    3085, 3097, 3099, 3120, 3136, 3152, 3159, 3188, 3210, 3228, 3234, 3245, 3250, 3256, 3264, 3276,
    3281, 3296, 3349, 3363, 3378, 3392, 3395, 3420, 3440, 3461, 3488, 3529, 3531, 3584, 3588, 3591,
    3600, 3602, 3614, 3616, 3628, 3634, 3650, 3657, 3668, 3683, 3685, 3713, 3716, 3720, 3726, 3729,
    3736, 3753, 3778, 3802, 3805, 3819, 3841, 3845, 3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032,
)


@dataclass(frozen=True)
class Tables:
    """A lattice codebook: points of ``group`` coordinates, each a level 0..``max_level`` stored in ``bits``
    bits (the value 2·level + 1); a group of levels is a code Σ level_i·2^(bits·i)."""

    grid: np.ndarray  # [P, group] uint8: each point's levels
    index: np.ndarray  # [2^(bits·group)] int32: the point of each code, −1 off the grid
    row: np.ndarray  # [2^(bits·group)] int32: an off-grid code's row of ``neighbours``, −1 for the others
    neighbours: np.ndarray  # [R, n] int32: an off-grid code's nearest points by (distance, index), −1 padded
    count: np.ndarray  # [R]: how many neighbours each row has
    odd: np.ndarray  # [P, group] float32: each point's values 2·level + 1
    bits: int = 3
    max_level: int = 7

    @property
    def group(self) -> int:
        return self.grid.shape[1]


@cache
def tables(kgrid: tuple[int, ...] = _KGRID_512, n_want: int = N_WANT, group: int = GROUP, bits: int = 3,
           max_level: int = 7) -> Tables:
    """ggml's ``iq3xs_init_impl`` / ``iq2xs_init_impl``: the grid (``kgrid``: each point's levels as a code; IQ3_S's
    512 by default), the code -> point map, and the neighbours at the ``n_want`` smallest distances of each
    off-grid code whose levels are all ≤ ``max_level`` (the only ones the encoder forms)."""
    kgrid = np.array(kgrid, dtype=np.int64)
    shifts = bits * np.arange(group)
    grid = ((kgrid[:, None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)
    size = 1 << (bits * group)
    index = np.full(size, -1, dtype=np.int32)
    index[kgrid] = np.arange(len(kgrid), dtype=np.int32)
    codes = np.arange(size)
    levels = (codes[:, None] >> shifts) & ((1 << bits) - 1)
    off = np.flatnonzero((index < 0) & (levels <= max_level).all(axis=1))
    dist2 = np.zeros((len(off), len(kgrid)), dtype=np.int32)
    for i in range(group):  # one coordinate at a time: [codes, P] temporaries only
        dist2 += ((2 * grid[:, i].astype(np.int32) + 1)[None] - (2 * levels[off, i] + 1)[:, None]) ** 2
    order = np.argsort(dist2, axis=1, kind="stable")  # ties by point index, as ggml's comparator
    lists = []
    for row in range(len(off)):
        d = dist2[row, order[row]]
        cutoff = np.unique(d)[n_want - 1]
        lists.append(order[row][d <= cutoff])
    neighbours = np.full((len(off), max(len(x) for x in lists)), -1, dtype=np.int32)
    for r, found in enumerate(lists):
        neighbours[r, : len(found)] = found
    row = np.full(size, -1, dtype=np.int32)
    row[off] = np.arange(len(off), dtype=np.int32)
    odd = (2 * grid.astype(np.int32) + 1).astype(F32)
    return Tables(grid, index, row, neighbours, (neighbours >= 0).sum(axis=1), odd, bits, max_level)


def _levels(t: Tables, inverse: np.ndarray, xval: np.ndarray) -> np.ndarray:
    """``clamp(nearest_int((inverse·|x| − 1)/2), 0, max_level)`` ``[M, S]`` for per-block inverse scales ``[M]``."""
    return np.clip(nearest_int(F32(0.5) * (inverse[:, None] * xval - F32(1))), 0, t.max_level)


def _codes(t: Tables, levels: np.ndarray) -> np.ndarray:
    """Level groups -> codes: ``[M, S]`` -> ``[M, S / group]``."""
    return (levels.reshape(levels.shape[0], -1, t.group) << (t.bits * np.arange(t.group))).sum(axis=-1)


def _snap(t: Tables, levels: np.ndarray, xval: np.ndarray, waux: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Grid points ``[M, S / group]`` for rounded ``levels``: the point itself, or for an off-grid group the
    neighbour nearest ``|x|`` at ``scale`` (``iq3_find_best_neighbour``, weighted by ``waux``); and which were on it."""
    codes = _codes(t, levels)
    point = t.index[codes]
    off = point < 0
    m, g = np.nonzero(off)
    rows = t.row[codes[m, g]]
    count = t.count[rows]
    width = t.neighbours.shape[1]
    edges = np.unique(np.minimum([*_BUCKETS, width], width))
    bucket = np.searchsorted(edges, count)  # groups with edges[k−1] < count ≤ edges[k] are searched together
    # one buffer for every bucket's distances (their fresh pages cost as much as the arithmetic); float32 named:
    # torch's default dtype is process-wide, and transformers changes it while it builds a model
    scratch = torch.empty(3 * int((np.bincount(bucket, minlength=len(edges)) * edges).max(initial=0)), dtype=torch.float32)
    for k, upper in enumerate(edges.tolist()):
        pick = np.flatnonzero(bucket == k)
        if not len(pick):
            continue
        mk, gk = m[pick], g[pick]
        found = t.neighbours[rows[pick], :upper]  # [G_b, upper]
        # [group, G_b, upper]: a coordinate of every candidate (padding reads point 0, set apart below)
        values = torch.from_numpy(np.take(t.odd, np.maximum(found, 0), axis=0)).permute(2, 0, 1)
        xv = torch.from_numpy(np.ascontiguousarray(xval.reshape(xval.shape[0], -1, t.group)[mk, gk].T))[..., None]
        wa = torch.from_numpy(np.ascontiguousarray(waux.reshape(waux.shape[0], -1, t.group)[mk, gk].T))[..., None]
        s = torch.from_numpy(scale[mk])[:, None]
        d2, diff, term = scratch[: 3 * found.size].view(3, *found.shape)
        for i, v in enumerate(values):  # a coordinate of every candidate at a time: ggml's order
            torch.mul(s, v, out=diff).sub_(xv[i])
            if i == 0:  # the sum starts at the first term (0 + t is t: the terms are ≥ +0)
                torch.mul(wa[0], diff, out=d2).mul_(diff)
            else:
                d2.add_(torch.mul(wa[i], diff, out=term).mul_(diff))
        d2 = d2.numpy()
        d2[found < 0] = np.inf  # padding
        point[mk, gk] = found[np.arange(len(pick)), np.argmin(d2, axis=1)]  # the first of equal distances, as ggml
    return point, ~off


def _sums(levels: np.ndarray, xval: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = (2 * levels + 1).astype(F32)
    return _running_sum(np.ascontiguousarray((w * xval * q).T)), _running_sum(np.ascontiguousarray((w * q * q).T))


def block_fit(xval: np.ndarray, w: np.ndarray, t: Tables | None = None, steps: int = 9, tiny: float = 0.0,
              resnap_all: bool = True, base: float = 15, increment: float = 0.2, top: np.ndarray | None = None,
              scale0: np.ndarray | None = None, resnap_always: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per block (rows of ``xval``, ``w`` ``[M, S]``; ``xval`` the magnitudes to fit, |x| for IQ3_S):
    (scale ``[M]``, grid points ``[M, S / group]``) as ggml picks them on grid ``t`` (IQ3_S's by default) from
    the trial inverse scales ``(base + increment·s)/max`` for s in −steps..steps; a block whose largest value
    is below ``tiny`` (or 0) is empty (scale 0, levels 0). When a group was off the grid, the groups are
    snapped again at the fitted scale: every group for IQ3_S, only the off-grid ones with
    ``resnap_all=False`` (IQ3_XXS, IQ2_XS), every group whatever the trials found with ``resnap_always`` (IQ2_XXS).
    ``top`` replaces max as the trials' denominator and ``scale0`` the scale kept if no trial fits (``top/base``)."""
    t = t or tables()
    waux = np.sqrt(w).astype(F32)
    top = xval.max(axis=1) if top is None else top
    empty = (top < F32(tiny)) | (top <= 0)
    top = np.where(empty, F32(1), top)
    scale = (top / F32(base)).astype(F32) if scale0 is None else scale0.astype(F32)
    best = np.zeros_like(top)
    levels = np.zeros(xval.shape, dtype=np.int32)
    on_grid = np.zeros((xval.shape[0], xval.shape[1] // t.group), dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(-steps, steps + 1):
            inverse = (F32(base) + F32(step) * F32(increment)) / top
            point, on = _snap(t, _levels(t, inverse, xval), xval, waux, F32(1) / inverse)
            trial = t.grid[point].reshape(xval.shape[0], -1).astype(np.int32)
            sumqx, sumq2 = _sums(trial, xval, w)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = np.where(better, sumqx / sumq2, scale)
            best = np.where(better, scale * sumqx, best)
            levels = np.where(better[:, None], trial, levels)
            on_grid = np.where(better[:, None], on, on_grid)
        redo = (resnap_always | ~on_grid.all(axis=1)) & (scale > 0) & ~empty
        if redo.any():
            r = np.flatnonzero(redo)
            point, _ = _snap(t, _levels(t, F32(1) / scale[r], xval[r]), xval[r], waux[r], scale[r])
            snapped = t.grid[point].reshape(len(r), -1)
            keep = on_grid[r].repeat(t.group, axis=1) & (not resnap_all) & (not resnap_always)
            levels[r] = np.where(keep, levels[r], snapped)
            sumqx, sumq2 = _sums(levels[r], xval[r], w[r])
            scale[r] = np.where(sumq2 > 0, sumqx / sumq2, scale[r])
    return np.where(empty, F32(0), scale).astype(F32), t.index[_codes(t, levels)]


@dataclass(frozen=True)
class IQ3Grid:
    """``d`` ``[N, 1]`` before the float16 store (×1.033 included), 4-bit block scales ``sc`` ``[N, 8]``, and
    which blocks were all zero (ggml writes no grid bytes for them) ``[N, 8]``."""

    d: np.ndarray
    sc: np.ndarray
    empty: np.ndarray

    def scale(self) -> np.ndarray:
        """Per block ``d·(1 + 2·sc)`` ``[N, 8]``, as the decoder computes it (with the stored d)."""
        return fp16_round(self.d) * (1 + 2 * self.sc.astype(np.int32)).astype(F32)


def fit(blocks: np.ndarray, qw: np.ndarray | None = None) -> tuple[IQ3Grid, np.ndarray, np.ndarray]:
    """(grid, points ``[N, 64]``, negative ``[N, 256]``) of ggml's encoder; with ``qw`` its imatrix fit."""
    n = blocks.shape[0]
    x = blocks.astype(F32, copy=False)
    scales, points = block_fit(np.where(x >= 0, x, -x).reshape(-1, SUB), error_weights(x, qw).reshape(-1, SUB))
    scales = scales.reshape(n, QK_K // SUB)
    top = scales.max(axis=1, initial=F32(0))
    d = (top / F32(31)).astype(F32)
    sc = np.clip(nearest_int(F32(0.5) * (safe_reciprocal(d)[:, None] * scales - F32(1))), 0, 15).astype(np.uint8)
    grid = IQ3Grid((d * F32(1.033))[:, None], np.where(top[:, None] > 0, sc, 0).astype(np.uint8), scales == 0)
    return grid, points.reshape(n, -1), ~(x >= 0)


def pack(grid: IQ3Grid, points: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Bytes of ``[N, 64]`` grid points and ``[N, 256]`` signs; a block marked empty in ``grid`` is skipped as ggml does."""
    n = points.shape[0]
    blocks = QK_K // SUB
    qs = (points & 255).astype(np.uint8).reshape(n, blocks, 8)
    signs = (negative.reshape(n, blocks, 4, 8).astype(np.uint8) << np.arange(8, dtype=np.uint8)).sum(axis=3, dtype=np.uint8)
    high = ((points >> 8) & 1).astype(np.uint8) * ~grid.empty.repeat(8, axis=1)
    qh = (high.reshape(n, 8, 8) << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)
    if grid.empty.any():  # ggml's qs/signs pointers stay put over an all-zero block
        slot = np.argsort(grid.empty, axis=1, kind="stable")
        keep = ~np.take_along_axis(grid.empty, slot, axis=1)[..., None]
        qs = np.take_along_axis(qs, slot[..., None], axis=1) * keep
        signs = np.take_along_axis(signs, slot[..., None], axis=1) * keep
    scales = (grid.sc[:, 0::2] | (grid.sc[:, 1::2] << 4)).astype(np.uint8)
    return np.concatenate([fp16_bytes(grid.d), qs.reshape(n, 64), qh, signs.reshape(n, 32), scales], axis=1)


def unpack(data: np.ndarray) -> tuple[IQ3Grid, np.ndarray, np.ndarray]:
    """(grid, points ``[N, 64]``, negative ``[N, 256]``) as stored (no block is marked empty)."""
    n = data.shape[0]
    high = (data[:, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1
    points = data[:, 2:66].astype(np.int32) | (high.reshape(n, 64).astype(np.int32) << 8)
    negative = ((data[:, 74:106, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(n, QK_K).astype(bool)
    raw = data[:, 106:110]
    sc = np.stack([raw & 15, raw >> 4], axis=2).reshape(n, 8)
    return IQ3Grid(fp16_field(data, 0), sc, np.zeros((n, 8), dtype=bool)), points, negative


def fit_grid(blocks: np.ndarray, qw: np.ndarray | None = None) -> IQ3Grid:
    """The grid of `fit`, for points chosen elsewhere: every block written in place (no ggml pointer lag)."""
    grid, _, _ = fit(blocks, qw)
    return IQ3Grid(grid.d, grid.sc, np.zeros_like(grid.empty))


def codebook() -> np.ndarray:
    """The 512 grid points' values ``[512, 4]`` float32 (odd, 1..15)."""
    return (2 * tables().grid.astype(np.int32) + 1).astype(F32)


def encode(blocks: np.ndarray) -> np.ndarray:
    return pack(*fit(blocks))


def encode_weighted(blocks: np.ndarray, qw: np.ndarray, row_sigma2: np.ndarray | None = None) -> np.ndarray:
    """``quantize_iq3_s`` with an importance matrix (σ² is the super-block's, not the row's)."""
    return pack(*fit(blocks, qw))


def decode(data: np.ndarray) -> np.ndarray:
    grid, points, negative = unpack(data)
    values = codebook()[points].reshape(-1, 8, SUB)
    signed = np.where(negative.reshape(-1, 8, SUB), F32(-1), F32(1))
    return ((grid.scale()[..., None] * values) * signed).reshape(-1, QK_K)
