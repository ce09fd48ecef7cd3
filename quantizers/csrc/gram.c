/* The upper triangle of the Gram matrix of bfloat16 token vectors, window by window, into a float64 total
   (compress.quantizers.gram; compress.quantizers.native builds it on first use).

   total[i, j] += Σ_t x[t, i] x[t, j] for each window's tokens t, each window's sum taken in float32 and added to
   the float64 total, windows in order: what the statistics' float32 products of the same values give, with the
   products of bfloat16 inputs exact in float32 as there; only the order of each window's float32 sum differs.
   It runs where the CPU multiplies bfloat16 pairs (AVX512-BF16's vdpbf16ps: two exact products per float32 lane,
   added in float32), at twice the float32 product's rate on the same cores, and reads the bfloat16 values without
   a float32 copy; torch has no CPU product from bfloat16 inputs to a float32 output (a bfloat16 output would round
   every window's sums to 8 bits).

   The layout the instruction wants is pairs of consecutive tokens side by side: gram_pack writes each window's
   x [tokens, d] as 32-bit words, word (k, i) = x[2k, i] | x[2k + 1, i] << 16 (an odd window's last word has a zero
   upper half, which adds nothing), panel by panel: the NR columns of a panel for every pair k, then the next panel's
   ([d / NR, pairs, NR]), so that both operands of a tile are read as sequential streams (a row of pairs would put
   consecutive reads of one column 4 d bytes apart: a cache line and a page each, 14336 wide). A tile of MR rows by
   NR columns of the total then takes, per pair k, two vector loads of its columns' words and MR broadcasts of its
   rows' words, 2 MR instructions into 2 MR accumulators that stay in registers for the whole window. Every entry is
   summed by one thread in token order, so the figures do not depend on the thread count. The tiles cover columns
   panel by panel and, in each, the rows up to the panel's right edge: the upper triangle, and whatever of the
   diagonal tiles lies below it. The windows are the outer loop: a panel's words of one window (pairs x 128 bytes)
   stay in the first-level cache while its row tiles pass. Measured on 2 threads of an AMD EPYC, 8 windows of 512
   tokens, counting two flops per multiply-add of the upper triangle: about 260, 350 and 360 GFLOP/s at 576, 1536
   and 4096 wide, against 115-135 for torch's float32 products; 14336 wide 210-260, where adding each window to the
   float64 total moves 1.6 GB. */

#include <stdint.h>

#if defined(COMPRESS_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

#define MR 8
#define NR 32

int gram_bf16_supported(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* x [windows, tokens, d] bfloat16 bits -> p [windows, d / NR, pairs, NR], pairs = (tokens + 1) / 2, for the pair
   rows [k0, k1) counted over all windows (d a multiple of NR). */
CLONES void gram_pack(int64_t k0, int64_t k1, int64_t tokens, int64_t d, const uint16_t *x, uint32_t *p)
{
    const int64_t pairs = (tokens + 1) / 2, panels = d / NR;
    for (int64_t k = k0; k < k1; k++) {
        const int64_t w = k / pairs, pair = k % pairs, t = 2 * pair;
        const uint16_t *a = x + (w * tokens + t) * d;
        const uint16_t *b = t + 1 < tokens ? a + d : 0;
        for (int64_t q = 0; q < panels; q++) {
            uint32_t *out = p + ((w * panels + q) * pairs + pair) * NR;
            const uint16_t *aq = a + q * NR;
            if (b) {
                const uint16_t *bq = b + q * NR;
                for (int64_t i = 0; i < NR; i++)
                    out[i] = (uint32_t)aq[i] | (uint32_t)bq[i] << 16;
            } else {
                for (int64_t i = 0; i < NR; i++)
                    out[i] = aq[i];
            }
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define ACC(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps();
#define STEP(r)                                                                              \
    {                                                                                        \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)row[r]);                          \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, a, b0);                                          \
        c##r##1 = _mm512_dpbf16_ps(c##r##1, a, b1);                                          \
    }
#define ADD(r)                                                                               \
    {                                                                                        \
        double *out = total + (i0 + r) * d + j0;                                             \
        _mm512_storeu_ps(sums, c##r##0);                                                     \
        _mm512_storeu_ps(sums + 16, c##r##1);                                                \
        for (int c = 0; c < NR; c++)                                                         \
            out[c] += (double)sums[c];                                                       \
    }

/* total [d, d] float64 += each window's float32 sums, for the column panels [q0, q1) (d a multiple of NR). */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void gram_bf16_upper(int64_t q0, int64_t q1, int64_t windows,
                                                                            int64_t pairs, int64_t d,
                                                                            const uint32_t *p, double *total)
{
    float sums[NR];
    const int64_t panels = d / NR;
    for (int64_t w = 0; w < windows; w++) {
        const uint32_t *window = p + w * panels * pairs * NR;
        for (int64_t q = q0; q < q1; q++) {
            const int64_t j0 = q * NR;
            const uint32_t *columns = window + q * pairs * NR;
            for (int64_t i0 = 0; i0 < j0 + NR; i0 += MR) {
                const uint32_t *rows = window + (i0 / NR) * pairs * NR + i0 % NR;
                ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
                for (int64_t k = 0; k < pairs; k++) {
                    const uint32_t *row = rows + k * NR;
                    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(columns + k * NR);
                    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(columns + k * NR + 16);
                    STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
                }
                ADD(0) ADD(1) ADD(2) ADD(3) ADD(4) ADD(5) ADD(6) ADD(7)
            }
        }
    }
}
#else
void gram_bf16_upper(int64_t q0, int64_t q1, int64_t windows, int64_t pairs, int64_t d, const uint32_t *p, double *total)
{
    (void)q0, (void)q1, (void)windows, (void)pairs, (void)d, (void)p, (void)total;  /* never called: not supported */
}
#endif
