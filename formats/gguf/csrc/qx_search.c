/* ggml's make_qx_quants (rmse_type 1) scale search, compiled: compress.formats.gguf._common.make_qx_quants's numpy
   procedure, the same float32 operations in the same order (built with -ffp-contract=off, no fast-math), so the
   chosen scales are those bit for bit, and so are the bytes the encoders write (tests/formats/gguf/test_native_search.py).

   Groups are taken TILE at a time, transposed so that each operation runs across the tile's groups (vectorised)
   while each group's sums still run over its values left to right, as ggml's scalar loops and the numpy version do.
   x and weights are [groups, n] float32 (weights NULL: x squared); scale and chosen (the inverse scale whose
   rounding was kept) [groups]. */

#include <math.h>
#include <stdint.h>

#if defined(COMPRESS_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

#define TILE 16
#define MAX_N 64

CLONES void qx_scales(int64_t groups, int64_t n, const float *x, const float *weights, int32_t nmax, float eps,
                      float *scale, float *chosen)
{
    float xt[MAX_N][TILE], wx[MAX_N][TILE], w[MAX_N][TILE];
    float top[TILE], iscale[TILE], slx[TILE], sl2[TILE], best[TILE], sc[TILE], pick[TILE];
    const float lo = (float)-nmax, hi = (float)(nmax - 1);
    for (int64_t g0 = 0; g0 < groups; g0 += TILE) {
        const int64_t m = groups - g0 < TILE ? groups - g0 : TILE;
        for (int64_t g = 0; g < TILE; g++) { /* a short last tile repeats its last group in the spare lanes */
            const int64_t src = g0 + (g < m ? g : m - 1);
            for (int64_t i = 0; i < n; i++) {
                xt[i][g] = x[src * n + i];
                w[i][g] = weights ? weights[src * n + i] : xt[i][g] * xt[i][g];
                wx[i][g] = w[i][g] * xt[i][g];
            }
        }
        for (int64_t g = 0; g < TILE; g++) { /* the value of largest magnitude, the first of equals; +0 if none */
            float amax = 0.0f, t = 0.0f;
            for (int64_t i = 0; i < n; i++) {
                const float ax = fabsf(xt[i][g]);
                if (ax > amax) {
                    amax = ax;
                    t = xt[i][g];
                }
            }
            top[g] = fabsf(t) < eps ? 1.0f : t;
        }
        for (int step = 0; step < 19; step++) { /* the plain inverse scale, then 0.1 apart: -9..-1, 1..9 */
            const int s = step == 0 ? 0 : (step <= 9 ? step - 10 : step - 9);
            for (int64_t g = 0; g < TILE; g++)
                iscale[g] = step == 0 ? (float)-nmax / top[g] : -((float)nmax + 0.1f * (float)s) / top[g];
            for (int64_t i = 0; i < n; i++) {
                for (int64_t g = 0; g < TILE; g++) {
                    float l = nearbyintf(xt[i][g] * iscale[g]);
                    l = l < lo ? lo : l;
                    l = l > hi ? hi : l;
                    const float a = wx[i][g] * l, b = (w[i][g] * l) * l;
                    slx[g] = i == 0 ? a : slx[g] + a;
                    sl2[g] = i == 0 ? b : sl2[g] + b;
                }
            }
            for (int64_t g = 0; g < TILE; g++) {
                if (step == 0) {
                    sc[g] = sl2[g] != 0.0f ? slx[g] / sl2[g] : 0.0f;
                    best[g] = sc[g] * slx[g];
                    pick[g] = iscale[g];
                } else if (sl2[g] > 0.0f && slx[g] * slx[g] > best[g] * sl2[g]) {
                    sc[g] = slx[g] / sl2[g];
                    best[g] = sc[g] * slx[g];
                    pick[g] = iscale[g];
                }
            }
        }
        for (int64_t g = 0; g < m; g++) {
            float amax = 0.0f;
            for (int64_t i = 0; i < n; i++)
                amax = fabsf(xt[i][g]) > amax ? fabsf(xt[i][g]) : amax;
            scale[g0 + g] = amax < eps ? 0.0f : sc[g];
            chosen[g0 + g] = pick[g];
        }
    }
}

/* Σ_i w·|err| or w·err² of one tile's candidate (levels L, scale and min per group): ((L·scale) + min) − x */
static inline void qkx2_error(int64_t n, float L[][TILE], float xt[][TILE], float w[][TILE], const float *scale,
                              const float *offset, int32_t use_mad, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        for (int64_t g = 0; g < TILE; g++) {
            float d = (L[i][g] * scale[g] + offset[g]) - xt[i][g];
            d = use_mad ? fabsf(d) : d * d;
            d = d * w[i][g];
            out[g] = i == 0 ? d : out[g] + d;
        }
    }
}

/* clamp(round((x − offset)·iscale), 0, nmax) of one tile */
static inline void qkx2_levels(int64_t n, float L[][TILE], float xt[][TILE], const float *iscale, const float *offset,
                               float nmax)
{
    for (int64_t i = 0; i < n; i++) {
        for (int64_t g = 0; g < TILE; g++) {
            float l = nearbyintf((xt[i][g] - offset[g]) * iscale[g]);
            l = l < 0.0f ? 0.0f : l;
            L[i][g] = l > nmax ? nmax : l;
        }
    }
}

/* ggml's make_qkx2_quants: compress.formats.gguf._common.make_qkx2_quants's numpy procedure (its docstring has the
   search). x and weights [groups, n]; scale and min [groups] (min subtracted, as ggml stores it), codes [groups, n]. */
CLONES void qkx2_fit(int64_t groups, int64_t n, const float *x, const float *weights, int32_t nmax, float rmin,
                     float rdelta, int32_t nstep, int32_t use_mad, float *scale_out, float *min_out, int32_t *codes)
{
    float xt[MAX_N][TILE], w[MAX_N][TILE], L[MAX_N][TILE];
    float lo[TILE], top[TILE], sum_w[TILE], sum_x[TILE];
    float best_iscale[TILE], best_offset[TILE], best[TILE], scale[TILE], offset[TILE];
    float iscale[TILE], used[TILE], cur[TILE], this_scale[TILE], this_min[TILE];
    float sum_l[TILE], sum_l2[TILE], sum_xl[TILE];
    int flat[TILE];
    const float fmax = (float)nmax;
    for (int64_t g0 = 0; g0 < groups; g0 += TILE) {
        const int64_t m = groups - g0 < TILE ? groups - g0 : TILE;
        for (int64_t g = 0; g < TILE; g++) {
            const int64_t src = g0 + (g < m ? g : m - 1);
            for (int64_t i = 0; i < n; i++) {
                xt[i][g] = x[src * n + i];
                w[i][g] = weights[src * n + i];
            }
        }
        for (int64_t g = 0; g < TILE; g++) {
            float mn = xt[0][g], mx = xt[0][g];
            for (int64_t i = 1; i < n; i++) { /* numpy's minimum and maximum: of equals (+0, -0) the later one */
                mn = xt[i][g] <= mn ? xt[i][g] : mn;
                mx = xt[i][g] >= mx ? xt[i][g] : mx;
            }
            lo[g] = mn > 0.0f ? 0.0f : mn;
            flat[g] = mx == lo[g];
            top[g] = flat[g] ? lo[g] + 1.0f : mx; /* any span serves a flat group: its codes are 0 */
            float sw = w[0][g], sx = w[0][g] * xt[0][g];
            for (int64_t i = 1; i < n; i++) {
                sw = sw + w[i][g];
                sx = sx + w[i][g] * xt[i][g];
            }
            sum_w[g] = sw;
            sum_x[g] = sx;
            iscale[g] = fmax / (top[g] - lo[g]);
            used[g] = lo[g];
            this_scale[g] = 1.0f / iscale[g];
            this_min[g] = lo[g];
        }
        qkx2_levels(n, L, xt, iscale, used, fmax);
        qkx2_error(n, L, xt, w, this_scale, used, use_mad, cur);
        for (int64_t g = 0; g < TILE; g++) {
            best_iscale[g] = iscale[g];
            best_offset[g] = used[g];
            best[g] = cur[g];
            scale[g] = this_scale[g];
            offset[g] = this_min[g];
        }
        for (int32_t step = 0; step <= nstep; step++) {
            const float numerator = (rmin + rdelta * (float)step) + fmax;
            for (int64_t g = 0; g < TILE; g++) {
                iscale[g] = numerator / (top[g] - offset[g]);
                used[g] = offset[g];
            }
            qkx2_levels(n, L, xt, iscale, used, fmax);
            for (int64_t i = 0; i < n; i++) {
                for (int64_t g = 0; g < TILE; g++) {
                    const float wl = w[i][g] * L[i][g], wl2 = wl * L[i][g], wlx = wl * xt[i][g];
                    sum_l[g] = i == 0 ? wl : sum_l[g] + wl;
                    sum_l2[g] = i == 0 ? wl2 : sum_l2[g] + wl2;
                    sum_xl[g] = i == 0 ? wlx : sum_xl[g] + wlx;
                }
            }
            for (int64_t g = 0; g < TILE; g++) {
                const float det = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
                this_scale[g] = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / det;
                this_min[g] = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / det;
                if (this_min[g] > 0.0f) {
                    this_scale[g] = sum_xl[g] / sum_l2[g];
                    this_min[g] = 0.0f;
                }
                sum_l[g] = det; /* kept for the choice below */
            }
            qkx2_error(n, L, xt, w, this_scale, this_min, use_mad, cur);
            for (int64_t g = 0; g < TILE; g++) {
                if (sum_l[g] > 0.0f && cur[g] < best[g]) {
                    best_iscale[g] = iscale[g];
                    best_offset[g] = used[g];
                    best[g] = cur[g];
                    scale[g] = this_scale[g];
                    offset[g] = this_min[g];
                }
            }
        }
        qkx2_levels(n, L, xt, best_iscale, best_offset, fmax);
        for (int64_t g = 0; g < m; g++) {
            scale_out[g0 + g] = flat[g] ? 0.0f : scale[g];
            min_out[g0 + g] = -offset[g];
            for (int64_t i = 0; i < n; i++)
                codes[(g0 + g) * n + i] = flat[g] ? 0 : (int32_t)L[i][g];
        }
    }
}

/* numpy's float mod by 256 (the sign of the divisor; -0 becomes +0): the level as ggml's uint8_t L array holds it */
static inline float mod256(float v)
{
    float r = fmodf(v, 256.0f);
    if (r == 0.0f)
        return 0.0f;
    return r < 0.0f ? r + 256.0f : r;
}

/* Σ w·(x − L/iscale)² of one group at inverse scale iscale, L = rint(iscale·x) clamped to nmax from above, or taken
   mod 256 (the plain try, read back from L) */
static inline float qp_error(int64_t n, const float *x, const float *w, float iscale, float nmax, int clamp)
{
    const float inverse = 1.0f / iscale;
    float total = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float l = nearbyintf(iscale * x[i]);
        l = clamp ? (l < nmax ? l : nmax) : mod256(l);
        const float diff = x[i] - inverse * l;
        const float term = (w[i] * diff) * diff;
        total = i == 0 ? term : total + term;
    }
    return total;
}

/* ggml's make_qp_quants: compress.formats.gguf._common.make_qp_quants's numpy procedure (8 trial inverse scales, then
   up to 5 passes of coordinate descent), one group at a time (its groups are a super-block's 8-16 sub-block scales,
   too few values to spread across vector lanes). x and w [groups, n]; scale [groups], codes [groups, n]. */
CLONES void qp_fit(int64_t groups, int64_t n, const float *x_all, const float *w_all, int32_t nmax_i, float eps,
                   float *scale_out, int32_t *codes)
{
    const float nmax = (float)nmax_i;
    float levels[MAX_N];
    for (int64_t g = 0; g < groups; g++) {
        const float *x = x_all + g * n, *w = w_all + g * n;
        float top = x[0];
        for (int64_t i = 1; i < n; i++)
            top = x[i] >= top ? x[i] : top;
        top = top > 0.0f ? top : 0.0f;
        const int empty = top < eps;
        if (empty)
            top = 1.0f;
        float chosen = nmax / top, best = qp_error(n, x, w, chosen, nmax, 0);
        for (int step = -4; step <= 4; step++) {
            if (step == 0)
                continue;
            const float iscale = (0.1f * (float)step + nmax) / top, cur = qp_error(n, x, w, iscale, nmax, 1);
            if (cur < best) {
                best = cur;
                chosen = iscale;
            }
        }
        float sumlx = 0.0f, suml2 = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            float l = nearbyintf(chosen * x[i]);
            l = l < nmax ? l : nmax;
            const float a = (w[i] * x[i]) * l, b = (w[i] * l) * l;
            sumlx = i == 0 ? a : sumlx + a;
            suml2 = i == 0 ? b : suml2 + b;
            levels[i] = mod256(l);
        }
        int active = !empty;
        for (int pass = 0; pass < 5 && active; pass++) {
            int changed = 0;
            for (int64_t i = 0; i < n; i++) {
                const float xi = x[i], wi = w[i], li = levels[i];
                const float slx = sumlx - (wi * xi) * li, sl2 = suml2 - (wi * li) * li;
                if (!(slx > 0.0f && sl2 > 0.0f))
                    continue;
                float fresh = nearbyintf((xi * sl2) / slx);
                fresh = fresh < nmax ? fresh : nmax;
                const float slx_new = slx + (wi * xi) * fresh, sl2_new = sl2 + (wi * fresh) * fresh;
                if (fresh != li && (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new) {
                    levels[i] = mod256(fresh);
                    sumlx = slx_new;
                    suml2 = sl2_new;
                    changed = 1;
                }
            }
            active = changed;
        }
        scale_out[g] = empty ? 0.0f : (suml2 > 0.0f ? sumlx / suml2 : 0.0f);
        for (int64_t i = 0; i < n; i++)
            codes[g * n + i] = empty ? 0 : (int32_t)levels[i];
    }
}

/* numpy's float32 -> int32 cast of a rounded value: exact where it fits, else (inf, NaN, beyond int32) INT_MIN, which
   the clamp that follows takes to its lower bound */
static inline float as_int32_level(float v, float lo, float hi)
{
    if (!(v >= -2147483648.0f && v < 2147483648.0f))
        return lo;
    return v < lo ? lo : (v > hi ? hi : v);
}

/* ggml's make_q3_quants with do_rmse: compress.formats.gguf._common.make_q3_quants's numpy procedure (plain rounding at
   -nmax/max, then up to 5 passes of x²-weighted coordinate descent), one group at a time. x [groups, n]; scale
   [groups] (signed), codes [groups, n] (L + nmax). */
CLONES void q3_fit(int64_t groups, int64_t n, const float *x_all, int32_t nmax_i, float eps, float *scale_out,
                   int32_t *codes)
{
    const float lo = (float)-nmax_i, hi = (float)(nmax_i - 1);
    float levels[MAX_N], w[MAX_N], wx[MAX_N];
    for (int64_t g = 0; g < groups; g++) {
        const float *x = x_all + g * n;
        float amax = 0.0f, top = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float ax = fabsf(x[i]);
            if (ax > amax) {
                amax = ax;
                top = x[i];
            }
        }
        const int empty = fabsf(top) < eps;
        const float iscale = (float)-nmax_i / (empty ? 1.0f : top);
        float sumlx = 0.0f, suml2 = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            float l = nearbyintf(iscale * x[i]);
            levels[i] = l < lo ? lo : (l > hi ? hi : l);
            w[i] = x[i] * x[i];
            wx[i] = w[i] * x[i];
            const float a = wx[i] * levels[i], b = (w[i] * levels[i]) * levels[i];
            sumlx = i == 0 ? a : sumlx + a;
            suml2 = i == 0 ? b : suml2 + b;
        }
        int moving = !empty;
        for (int pass = 0; pass < 5 && moving; pass++) {
            int changed = 0;
            for (int64_t i = 0; i < n; i++) {
                const float li = levels[i];
                const float slx = sumlx - wx[i] * li, sl2 = suml2 - (w[i] * li) * li;
                const float fresh = as_int32_level(nearbyintf((x[i] * sl2) / slx), lo, hi);
                const float slx_new = slx + wx[i] * fresh, sl2_new = sl2 + (w[i] * fresh) * fresh;
                if (slx > 0.0f && fresh != li && sl2_new > 0.0f &&
                    (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new) {
                    levels[i] = fresh;
                    sumlx = slx_new;
                    suml2 = sl2_new;
                    changed = 1;
                }
            }
            moving = changed;
        }
        scale_out[g] = empty ? 0.0f : (suml2 > 0.0f ? sumlx / suml2 : 0.0f);
        for (int64_t i = 0; i < n; i++)
            codes[g * n + i] = empty ? 0 : (int32_t)levels[i] + nmax_i;
    }
}
