/* GPTQ's (and SparseGPT's) column loop for an integer grid and for a GGUF affine block grid, compiled (compress.quantizers.native
   builds it on first use).

   The same float32 operations in the same order as the torch loops (compress.quantizers.gptq_columns, .gguf_gptq),
   one correctly rounded IEEE operation at a time: built with -ffp-contract=off (no fused multiply-adds) and no
   fast-math, so every value equals the torch loop's bit for bit. Each row is independent of the others, so the
   caller may split the rows between threads: a call works on rows [r0, r1) only.

   Layout: the lazy batch's columns are rows of length `ld` (the layer's output rows): W1, err [block, ld]; U1 is the
   batch's square of the upper inverse Hessian factor, row stride `ldu`. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(COMPRESS_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Column i's scaled error e fed to the batch's later columns: W1[k][r] -= U1[i][k] * e[r] for k in (i, block), each
   product rounded, then subtracted (torch's mul, then sub_: compress.quantizers.gptq_columns.feed_error_). */
static inline void feed(float *W1, const float *e, const float *U1_row, int64_t i, int64_t block, int64_t r0,
                        int64_t r1, int64_t ld)
{
    for (int64_t k = i + 1; k < block; k++) {
        const float u = U1_row[k];
        float *later = W1 + k * ld;
        for (int64_t r = r0; r < r1; r++)
            later[r] -= u * e[r];
    }
}

/* Integer grid (compress.quantizers.grid.QuantScheme.round_column): columns [first, last) of the batch, each rounded
   to its group's grid, codes the level clamped to [lo, hi] (a zero-point grid adds the zero before clamping and
   subtracts it again to dequantize), its error divided by its pivot U1[i][i] and fed. codes and deq [block, ld];
   scale and zero [groups, ld]; group[i] the group of batch column i. SparseGPT's columns too: `mask` [block, ld]
   (NULL: none) marks pruned weights, rounded as +0 (torch.where(mask, 0.0, w)); with `quantize` 0 there is no grid
   (scale, zero, group, codes unread and unwritten) and a column's value is its weight, +0 where pruned. */
CLONES void gptq_int_columns(int64_t first, int64_t last, int64_t block, int64_t r0, int64_t r1, int64_t ld,
                             float *W1, float *codes, float *deq, float *err, const float *U1, int64_t ldu,
                             const float *scale, const float *zero, const int64_t *group, float lo, float hi,
                             int32_t zero_point, const uint8_t *mask, int32_t quantize)
{
    for (int64_t i = first; i < last; i++) {
        float *w = W1 + i * ld, *c = codes + i * ld, *d = deq + i * ld, *e = err + i * ld;
        const uint8_t *m = mask ? mask + i * ld : NULL;
        const float pivot = U1[i * ldu + i];
        if (!quantize) {
            for (int64_t r = r0; r < r1; r++) {
                d[r] = m && m[r] ? 0.0f : w[r];
                e[r] = (w[r] - d[r]) / pivot;
            }
            feed(W1, e, U1 + i * ldu, i, block, r0, r1, ld);
            continue;
        }
        const float *s = scale + group[i] * ld, *z = zero + group[i] * ld;
        if (zero_point) {
            for (int64_t r = r0; r < r1; r++) {
                const float v = m && m[r] ? 0.0f : w[r];
                float q = nearbyintf(v / s[r]) + z[r];
                q = q < lo ? lo : q;
                q = q > hi ? hi : q;
                c[r] = q;
                d[r] = (q - z[r]) * s[r];
                e[r] = (w[r] - d[r]) / pivot;
            }
        } else {
            for (int64_t r = r0; r < r1; r++) {
                const float v = m && m[r] ? 0.0f : w[r];
                float q = nearbyintf(v / s[r]);
                q = q < lo ? lo : q;
                q = q > hi ? hi : q;
                c[r] = q;
                d[r] = q * s[r];
                e[r] = (w[r] - d[r]) / pivot;
            }
        }
        feed(W1, e, U1 + i * ldu, i, block, r0, r1, ld);
    }
}

/* GGUF affine block grid (compress.quantizers.gguf_gptq): columns [first, last) of the batch, each row's code the
   level round((w + offset) / safe) clamped to [lo, hi] (safe: the step, 1 where it is 0), its value
   step * level - offset; codes, step, offset and safe [last - first, ld] hold the grid block's columns. The error is
   fed as above. */
CLONES void gguf_affine_columns(int64_t first, int64_t last, int64_t block, int64_t r0, int64_t r1, int64_t ld,
                                float *W1, float *codes, float *err, const float *U1, int64_t ldu, const float *step,
                                const float *offset, const float *safe, float lo, float hi)
{
    for (int64_t i = first; i < last; i++) {
        const int64_t c = i - first;
        const float *s = step + c * ld, *o = offset + c * ld, *f = safe + c * ld;
        float *w = W1 + i * ld, *q = codes + c * ld, *e = err + i * ld;
        const float pivot = U1[i * ldu + i];
        for (int64_t r = r0; r < r1; r++) {
            float level = nearbyintf((w[r] + o[r]) / f[r]);
            level = level < lo ? lo : level;
            level = level > hi ? hi : level;
            q[r] = level;
            e[r] = (w[r] - (s[r] * level - o[r])) / pivot;
        }
        feed(W1, e, U1 + i * ldu, i, block, r0, r1, ld);
    }
}
