/* GPTQ's column loop for an integer grid, compiled (compress.quantizers.native builds it on first use).

   The same float32 operations in the same order as the torch loop of compress.quantizers.gptq_columns, one
   correctly rounded IEEE operation at a time: built with -ffp-contract=off (no fused multiply-adds) and no
   fast-math, so every value equals the torch loop's bit for bit. Each row is independent of the others, so the
   caller may split the rows between threads: a call works on rows [r0, r1) only.

   Layout: the block's columns are rows of length `ld` (the layer's output rows): W1, codes, deq, err [block, ld];
   U1 is the block's square of the upper inverse Hessian factor, row stride `ldu`; scale and zero [groups, ld];
   group[i] the group of block column i. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(COMPRESS_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Columns [first, last) of the block: each rounded to its group's grid (codes: the level, clamped to [lo, hi];
   zero-point grids add the zero before clamping and subtract it again), its error divided by its pivot U1[i][i]
   fed to the block's later columns (each product rounded, then subtracted). */
CLONES void gptq_int_columns(int64_t first, int64_t last, int64_t block, int64_t r0, int64_t r1, int64_t ld,
                             float *W1, float *codes, float *deq, float *err, const float *U1, int64_t ldu,
                             const float *scale, const float *zero, const int64_t *group, float lo, float hi,
                             int32_t zero_point)
{
    for (int64_t i = first; i < last; i++) {
        const float *s = scale + group[i] * ld, *z = zero + group[i] * ld;
        float *w = W1 + i * ld, *c = codes + i * ld, *d = deq + i * ld, *e = err + i * ld;
        const float pivot = U1[i * ldu + i];
        if (zero_point) {
            for (int64_t r = r0; r < r1; r++) {
                float q = nearbyintf(w[r] / s[r]) + z[r];
                q = q < lo ? lo : q;
                q = q > hi ? hi : q;
                c[r] = q;
                d[r] = (q - z[r]) * s[r];
                e[r] = (w[r] - d[r]) / pivot;
            }
        } else {
            for (int64_t r = r0; r < r1; r++) {
                float q = nearbyintf(w[r] / s[r]);
                q = q < lo ? lo : q;
                q = q > hi ? hi : q;
                c[r] = q;
                d[r] = q * s[r];
                e[r] = (w[r] - d[r]) / pivot;
            }
        }
        for (int64_t k = i + 1; k < block; k++) {
            const float u = U1[i * ldu + k];
            float *later = W1 + k * ld;
            for (int64_t r = r0; r < r1; r++)
                later[r] -= u * e[r];
        }
    }
}
