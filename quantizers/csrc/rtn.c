/* Round-to-nearest on an integer grid (compress.quantizers.rtn), compiled (compress.quantizers.native builds it on
   first use).

   For each (row, group) with scale s and zero point z (computed by the caller as compress.quantizers.grid computes
   them), each weight's code q = clamp(rint(w / s) + z, 0, M) and its value (q - z) * s: grid.quantize's and
   grid.dequantize's operations in their order (the correctly rounded division, rint, sum, clamp; then difference
   and product; -ffp-contract=off), so the same bits. Beside them each row's sums of w**2 and (w - value)**2 in double,
   in column order. torch takes ~11 passes over the weight for these; here it is read once. A bfloat16 weight is
   widened as it is read (its bits are the upper half of the float32 it stands for), with no float32 copy.

   Rows are independent: a call works on rows [r0, r1) only. */

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(COMPRESS_CLONES)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline float load(const void *w, int64_t i, int bf16)
{
    if (!bf16)
        return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* w [rows, groups * width] float32 or bfloat16; values the same shape float32, codes int32; scale, zero
   [rows, groups]; energy, error [rows] double. */
static inline __attribute__((always_inline)) void rtn_rows(int64_t r0, int64_t r1, int64_t groups, int64_t width,
                                                           const void *w, int bf16, const float *scale, const float *zero,
                                                           float max_code, int32_t *codes, float *values, double *energy,
                                                           double *error)
{
    const int64_t in = groups * width;
    for (int64_t r = r0; r < r1; r++) {
        double e = 0.0, d = 0.0;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scale[r * groups + g], z = zero[r * groups + g];
            const int64_t at = r * in + g * width;
            float *v = values + at;
            int32_t *c = codes + at;
            for (int64_t j = 0; j < width; j++) {
                float q = rintf(load(w, at + j, bf16) / s) + z;
                q = q < 0.0f ? 0.0f : q;  /* one comparison per statement: selects the compiler vectorizes */
                q = q > max_code ? max_code : q;
                c[j] = (int32_t)q;
                v[j] = (q - z) * s;
            }
            for (int64_t j = 0; j < width; j++) {
                const double a = load(w, at + j, bf16), b = a - (double)v[j];
                e += a * a;
                d += b * b;
            }
        }
        energy[r] = e;
        error[r] = d;
    }
}

CLONES void rtn_int(int64_t r0, int64_t r1, int64_t groups, int64_t width, const float *w, const float *scale,
                    const float *zero, float max_code, int32_t *codes, float *values, double *energy, double *error)
{
    rtn_rows(r0, r1, groups, width, w, 0, scale, zero, max_code, codes, values, energy, error);
}

CLONES void rtn_int_bf16(int64_t r0, int64_t r1, int64_t groups, int64_t width, const uint16_t *w, const float *scale,
                         const float *zero, float max_code, int32_t *codes, float *values, double *energy, double *error)
{
    rtn_rows(r0, r1, groups, width, w, 1, scale, zero, max_code, codes, values, energy, error);
}
