/* Round-to-nearest on an integer grid (compress.quantizers.rtn), compiled (compress.quantizers.native builds it on
   first use).

   For each (row, group) with scale s and zero point z (computed by the caller as compress.quantizers.grid computes
   them), each weight's code q = clamp(rint(w / s) + z, 0, M) and its value (q - z) * s: grid.quantize's and
   grid.dequantize's operations in their order (the correctly rounded division, rint, sum, clamp; then difference
   and product; -ffp-contract=off), so the same bits. Beside them each row's sums of w**2 and (w - value)**2 in
   double, in LANES partial sums (column j's terms in sum j % LANES, each in column order, then the partial sums in
   order): one running sum would wait on each addition; LANES of them are a vector's lanes. torch takes ~11 passes over
   the weight for these; here it is read once. A bfloat16 weight is widened as it is read (its bits are the upper half
   of the float32 it stands for), with no float32 copy, and its values are written rounded to bfloat16. Codes are
   bytes (every integer grid has at most 8 bits): with values in the weight's dtype, 3 bytes are written per bfloat16
   weight where int32 codes and float32 values would be 8 (64 GB for an 8B model, on pages the kernel zeroes unless a
   buffer is reused, `compress.quantizers.pages`).

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

#define STRIP 256
#define LANES 8  /* partial sums of a row, each over every LANES-th column: the sums vectorize */

/* A float32 value as bfloat16, rounded to nearest even (torch's conversion, for the finite values written here). */
static inline uint16_t bf16_bits(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* w [rows, groups * width] float32 or bfloat16; values the same shape in w's dtype (a bfloat16 weight's values are
   the float32 values rounded, as a bfloat16 model holds them), codes uint8; scale, zero [rows, groups]; energy, error
   [rows] double, of the float32 values. values may be w itself: each strip of w is read before its values are
   written over it. */
static inline __attribute__((always_inline)) void rtn_rows(int64_t r0, int64_t r1, int64_t groups, int64_t width,
                                                           const void *w, int bf16, const float *scale, const float *zero,
                                                           float max_code, uint8_t *codes, void *values, double *energy,
                                                           double *error)
{
    const int64_t in = groups * width;
    float exact[STRIP];  /* a strip of a group's float32 values */
    for (int64_t r = r0; r < r1; r++) {
        double e[LANES] = {0.0}, d[LANES] = {0.0};  /* column j's terms go to lane j % LANES */
        int64_t lane = 0;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scale[r * groups + g], z = zero[r * groups + g];
            for (int64_t j0 = 0; j0 < width; j0 += STRIP) {
                const int64_t at = r * in + g * width + j0, n = width - j0 < STRIP ? width - j0 : STRIP;
                for (int64_t j = 0; j < n; j++) {
                    float q = rintf(load(w, at + j, bf16) / s) + z;
                    q = q < 0.0f ? 0.0f : q;  /* one comparison per statement: selects the compiler vectorizes */
                    q = q > max_code ? max_code : q;
                    codes[at + j] = (uint8_t)q;
                    exact[j] = (q - z) * s;
                }
                int64_t j = 0;
                if (lane == 0)
                    for (; j + LANES <= n; j += LANES)
                        for (int l = 0; l < LANES; l++) {
                            const double a = load(w, at + j + l, bf16), b = a - (double)exact[j + l];
                            e[l] += a * a;
                            d[l] += b * b;
                        }
                for (; j < n; j++, lane = (lane + 1) % LANES) {
                    const double a = load(w, at + j, bf16), b = a - (double)exact[j];
                    e[lane] += a * a;
                    d[lane] += b * b;
                }
                if (bf16)  /* the strip of w is read: values may be w itself */
                    for (int64_t j = 0; j < n; j++)
                        ((uint16_t *)values)[at + j] = bf16_bits(exact[j]);
                else
                    memcpy((float *)values + at, exact, n * sizeof(float));
            }
        }
        double te = 0.0, td = 0.0;
        for (int l = 0; l < LANES; l++) {
            te += e[l];
            td += d[l];
        }
        energy[r] = te;
        error[r] = td;
    }
}

CLONES void rtn_int(int64_t r0, int64_t r1, int64_t groups, int64_t width, const float *w, const float *scale,
                    const float *zero, float max_code, uint8_t *codes, float *values, double *energy, double *error)
{
    rtn_rows(r0, r1, groups, width, w, 0, scale, zero, max_code, codes, values, energy, error);
}

CLONES void rtn_int_bf16(int64_t r0, int64_t r1, int64_t groups, int64_t width, const uint16_t *w, const float *scale,
                         const float *zero, float max_code, uint8_t *codes, uint16_t *values, double *energy, double *error)
{
    rtn_rows(r0, r1, groups, width, w, 1, scale, zero, max_code, codes, values, energy, error);
}

/* Each (row, group)'s smallest and largest weight, widened to float32 (`grid.group_extremes`' values: a min or max
   of finite values is one of them, exactly, in either dtype). A zero's sign may differ from torch's, which no grid
   reads (the symmetric grid takes |extreme|; the asymmetric clamps at zero, whose code is the same). low, high
   [rows, groups]. */
static inline __attribute__((always_inline)) void extremes_rows(int64_t r0, int64_t r1, int64_t groups, int64_t width,
                                                                const void *w, int bf16, float *low, float *high)
{
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = (r * groups + g) * width;
            float lo = load(w, at, bf16), hi = lo;
            for (int64_t j = 1; j < width; j++) {
                const float x = load(w, at + j, bf16);
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
            low[r * groups + g] = lo;
            high[r * groups + g] = hi;
        }
}

CLONES void extremes(int64_t r0, int64_t r1, int64_t groups, int64_t width, const float *w, float *low, float *high)
{
    extremes_rows(r0, r1, groups, width, w, 0, low, high);
}

CLONES void extremes_bf16(int64_t r0, int64_t r1, int64_t groups, int64_t width, const uint16_t *w, float *low, float *high)
{
    extremes_rows(r0, r1, groups, width, w, 1, low, high);
}
