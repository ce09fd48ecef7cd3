/* Causal self-attention of bfloat16 queries, keys and values on the CPU, where it multiplies bfloat16 pairs
   (AVX512-BF16's vdpbf16ps); compress.kernels.cpu_attention loads it (compress.quantizers.native builds it).

   The arithmetic is torch's CPU flash attention's for bfloat16 inputs (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp):
   the scores q·k as float32 sums of exact products, times the scale; each row's maximum over its keys 0..t; p =
   exp(score − max) in float32, summed in float32, and rounded to bfloat16 for the product with the values; the
   output Σ p v in float32 times 1 / Σ p, rounded to bfloat16 (to nearest even, as torch). Only the order of the
   float32 sums and the exponential's last bit differ. On CPUs without a bfloat16 product (AMD's before Zen 4) torch's
   kernel hands its bfloat16 products to MKL, which widens them to float32 and runs its float32 product on small
   blocks: about 70 GFLOP/s on two cores of an AMD EPYC, where the bfloat16 product runs at about 350.

   Work: one unit per (batch, head), units [u0, u1) on the calling thread. A unit packs its key/value head (once
   per run of query heads sharing it: grouped-query attention) into the layouts the instruction reads, as in
   csrc/gram.c of the quantizers: keys as 32-bit words of two consecutive dimensions, 16 keys side by side
   ([keys / 16, dim / 2, 16]); values as words of two consecutive keys, a dimension per word ([keys / 2, dim]). Then
   for each tile of MR query rows: the scores of every key up to the tile's last row (a multiple of 32 keys; keys
   after a row's position are masked to nothing), the softmax row by row, and the product with the values, 32
   dimensions at a time, every accumulator in a register. The rows of a score tile are the whole key range (no
   online rescaling): MR x keys float32 stays in the second-level cache up to tens of thousands of tokens. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 8  /* query rows per tile; the caller checks the CPU (compress.quantizers.gram's gram_bf16_supported) */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))

/* exp(x) for x <= 0: n = round(x / ln 2), r = x − n ln 2 in two parts, Cephes' expf polynomial for exp(r), times
   2^n. Within about an ulp of expf; below −103 it gives exp(−103), a float32 subnormal that rounds to 0 in bfloat16
   (masked keys are zeroed by the caller, not by this). */
TARGET static inline __m512 exp_nonpositive(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));  /* below, exp rounds to 0 in float32 */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline uint32_t word(const uint16_t *x)
{
    uint32_t w;
    memcpy(&w, x, sizeof w);
    return w;
}

/* keys [tokens, dim] (row stride ks) -> kp [padded / 16, dim / 2, 16] words; values -> vp [padded / 2, dim]. */
static void pack_head(int64_t tokens, int64_t padded, int64_t dim, const uint16_t *k, int64_t ks, const uint16_t *v,
                      int64_t vs, uint32_t *kp, uint32_t *vp)
{
    const int64_t half = dim / 2;
    for (int64_t s = 0; s < padded; s++) {
        uint32_t *out = kp + (s / 16) * half * 16 + s % 16;
        for (int64_t p = 0; p < half; p++)
            out[p * 16] = s < tokens ? word(k + s * ks + 2 * p) : 0;
    }
    for (int64_t j = 0; j < padded / 2; j++) {
        const int64_t s = 2 * j;
        for (int64_t d = 0; d < dim; d++) {
            const uint32_t lo = s < tokens ? v[s * vs + d] : 0, hi = s + 1 < tokens ? v[(s + 1) * vs + d] : 0;
            vp[j * dim + d] = lo | hi << 16;
        }
    }
}

#define SACC(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps();
#define SSTEP(r)                                                                          \
    {                                                                                     \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)word(qrow[r] + 2 * p));        \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, a, b0);                                       \
        c##r##1 = _mm512_dpbf16_ps(c##r##1, a, b1);                                       \
    }
#define SSTORE(r)                                                                         \
    {                                                                                     \
        _mm512_storeu_ps(scores + (r) * padded + s0, c##r##0);                            \
        _mm512_storeu_ps(scores + (r) * padded + s0 + 16, c##r##1);                       \
    }
#define PSTEP(r)                                                                          \
    {                                                                                     \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)prow[(r) * (padded / 2) + j]);  \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, a, b0);                                       \
        c##r##1 = _mm512_dpbf16_ps(c##r##1, a, b1);                                       \
    }
#define PSTORE(r)                                                                         \
    if (t0 + (r) < tokens) {                                                              \
        const __m512 inv = _mm512_set1_ps(reciprocal[r]);                                 \
        uint16_t *o = out + (t0 + (r)) * os + d0;                                         \
        _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(c##r##0, inv)));       \
        _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(c##r##1, inv))); \
    }

/* The rows [t0, t0 + MR) of one head: q rows qrow[r] (clamped to the last token), keys and values packed,
   out [tokens, os] (this head's columns). */
TARGET static void tile(int64_t t0, int64_t tokens, int64_t padded, int64_t dim, const uint16_t *const *qrow,
                        const uint32_t *kp, const uint32_t *vp, float scale, float *scores, uint16_t *probs,
                        uint16_t *out, int64_t os)
{
    const int64_t half = dim / 2;
    const int64_t last = t0 + MR < tokens ? t0 + MR : tokens;  /* keys [0, last) reach some row of the tile */
    const int64_t keys = (last + 31) / 32 * 32;
    for (int64_t s0 = 0; s0 < keys; s0 += 32) {
        const uint32_t *k0 = kp + (s0 / 16) * half * 16, *k1 = k0 + half * 16;
        SACC(0) SACC(1) SACC(2) SACC(3) SACC(4) SACC(5) SACC(6) SACC(7)
        for (int64_t p = 0; p < half; p++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + p * 16);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
            SSTEP(0) SSTEP(1) SSTEP(2) SSTEP(3) SSTEP(4) SSTEP(5) SSTEP(6) SSTEP(7)
        }
        SSTORE(0) SSTORE(1) SSTORE(2) SSTORE(3) SSTORE(4) SSTORE(5) SSTORE(6) SSTORE(7)
    }
    float reciprocal[MR];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < MR; r++) {
        float *row = scores + r * padded;
        uint16_t *prob = probs + r * padded;
        const int64_t valid = t0 + r < tokens ? t0 + r + 1 : 1;  /* a padding row's figures are never stored */
        __m512 vmax = _mm512_set1_ps(-__builtin_inff());
        for (int64_t s = 0; s < keys; s += 16) {
            const __mmask16 in = s >= valid ? 0 : s + 16 <= valid ? 0xFFFF : (__mmask16)((1u << (valid - s)) - 1);
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + s), vscale);
            _mm512_storeu_ps(row + s, x);
            vmax = _mm512_mask_max_ps(vmax, in, vmax, x);
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t s = 0; s < keys; s += 16) {
            const __mmask16 in = s >= valid ? 0 : s + 16 <= valid ? 0xFFFF : (__mmask16)((1u << (valid - s)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(in, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + s), m)));
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256((__m256i *)(prob + s), (__m256i)_mm512_cvtneps_pbh(e));
        }
        reciprocal[r] = 1.0f / _mm512_reduce_add_ps(vsum);
    }
    const uint32_t *prow = (const uint32_t *)probs;  /* row r's words of two keys: prow[r * padded / 2 + j] */
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
        SACC(0) SACC(1) SACC(2) SACC(3) SACC(4) SACC(5) SACC(6) SACC(7)
        for (int64_t j = 0; j < keys / 2; j++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(vp + j * dim + d0);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(vp + j * dim + d0 + 16);
            PSTEP(0) PSTEP(1) PSTEP(2) PSTEP(3) PSTEP(4) PSTEP(5) PSTEP(6) PSTEP(7)
        }
        PSTORE(0) PSTORE(1) PSTORE(2) PSTORE(3) PSTORE(4) PSTORE(5) PSTORE(6) PSTORE(7)
    }
}

/* Units [u0, u1) of heads x batch: q [batch, heads, tokens, dim] with element strides qs[0..2] (batch, head,
   token; dim contiguous), k and v [batch, kv_heads, tokens, dim] likewise, out [batch, tokens, heads, dim]
   contiguous. dim a multiple of 32, heads a multiple of kv_heads. Returns 0, or 1 if its buffers could not be had. */
TARGET int attention_bf16_causal(int64_t u0, int64_t u1, int64_t heads, int64_t kv_heads, int64_t tokens, int64_t dim,
                                 const uint16_t *q, const int64_t *qs, const uint16_t *k, const int64_t *ks,
                                 const uint16_t *v, const int64_t *vs, float scale, uint16_t *out)
{
    const int64_t padded = (tokens + 31) / 32 * 32, group = heads / kv_heads;
    uint32_t *kp = aligned_alloc(64, (size_t)(padded * dim * 2));
    uint32_t *vp = aligned_alloc(64, (size_t)(padded * dim * 2));
    float *scores = aligned_alloc(64, (size_t)(MR * padded * 4));
    uint16_t *probs = aligned_alloc(64, (size_t)(MR * padded * 2));
    if (!kp || !vp || !scores || !probs) {
        free(kp), free(vp), free(scores), free(probs);
        return 1;
    }
    int64_t packed = -1;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / heads, h = u % heads, g = h / group;
        if (b * kv_heads + g != packed) {
            pack_head(tokens, padded, dim, k + b * ks[0] + g * ks[1], ks[2], v + b * vs[0] + g * vs[1], vs[2], kp, vp);
            packed = b * kv_heads + g;
        }
        const uint16_t *qh = q + b * qs[0] + h * qs[1];
        uint16_t *oh = out + (b * tokens * heads + h) * dim;
        for (int64_t t0 = 0; t0 < tokens; t0 += MR) {
            const uint16_t *qrow[MR];
            for (int64_t r = 0; r < MR; r++)
                qrow[r] = qh + (t0 + r < tokens ? t0 + r : tokens - 1) * qs[2];
            tile(t0, tokens, padded, dim, qrow, kp, vp, scale, scores, probs, oh, heads * dim);
        }
    }
    free(kp), free(vp), free(scores), free(probs);
    return 0;
}
#else
int attention_bf16_causal(int64_t u0, int64_t u1, int64_t heads, int64_t kv_heads, int64_t tokens, int64_t dim,
                          const uint16_t *q, const int64_t *qs, const uint16_t *k, const int64_t *ks,
                          const uint16_t *v, const int64_t *vs, float scale, uint16_t *out)
{
    (void)u0, (void)u1, (void)heads, (void)kv_heads, (void)tokens, (void)dim, (void)q, (void)qs, (void)k, (void)ks;
    (void)v, (void)vs, (void)scale, (void)out;
    return 1;  /* never called: not supported */
}
#endif
