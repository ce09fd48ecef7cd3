/* ggml's make_qx_quants (rmse_type 1) scale search, compiled: compress.formats.gguf._common.make_qx_quants's numpy
   procedure, the same float32 operations in the same order (built with -ffp-contract=off, no fast-math), so the
   chosen scales are those bit for bit, and so are the bytes the encoders write (tests/formats/test_gguf_native.py).

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
