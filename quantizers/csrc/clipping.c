/* The clipping search of an integer grid (compress.quantizers.grid.mse_qparams), compiled (compress.quantizers.native
   builds it on first use; compress.quantizers.clipping calls it).

   For each (row, group) and each candidate clipping range c (its scale s_c and zero point z_c, computed by the caller
   as the torch search computes them), the error sum_j |w_j - s_c * clamp(rint(w_j / s_c), -z_c, M - z_c)| ** norm;
   the result is the first candidate with the smallest sum. Each rounding error is the torch search's bit for bit
   (the same correctly rounded division, rint, clamp, product and difference; -ffp-contract=off). The power is taken
   as exp2(norm * log2|e|) with short polynomials, within 1e-6 of the exact value (torch's exp and log are within a
   few ulps), and each candidate's sum runs over the group's weights in order: where two candidates' sums lie within
   float32 noise of each other either may be chosen, as with the torch search.

   The loop over candidates is innermost, so the compiler vectorizes it (8 candidates per AVX2 instruction, 16 per
   AVX-512 one: a clone for each, chosen when the library is loaded), and
   each candidate's sum has one order whatever the instruction set. Rows are independent: a call works on rows
   [r0, r1) only. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(COMPRESS_CLONES)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

static inline float from_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t to_bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* |d| ** norm (norm > 0); 0 where |d| is below the smallest normal float32 (its power underflows anyway). */
static inline float power(float d, float norm)
{
    const int32_t b = (int32_t)(to_bits(d) & 0x7fffffffu);  /* signed: AVX2 compares only signed integers */
    /* log2|d| = e + log2(m), m folded into [sqrt(1/2), sqrt(2)): log2(m) = (2 / ln 2) atanh(t), t = (m - 1) / (m + 1) */
    float m = from_bits(((uint32_t)b & 0x7fffffu) | 0x3f800000u);
    float e = (float)((b >> 23) - 127);
    const int fold = m > 1.41421356f;
    const float halved = m * 0.5f, raised = e + 1.0f;  /* both taken, then chosen: selects the compiler vectorizes */
    m = fold ? halved : m;
    e = fold ? raised : e;
    const float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
    const float log2m = t * (2.88539008f + t2 * (0.961796694f + t2 * (0.577078009f + t2 * (0.412198578f + t2 * 0.320598897f))));
    float y = norm * (e + log2m);
    y = y < -126.0f ? -126.0f : y;  /* one comparison per statement: selects the compiler vectorizes */
    y = y > 127.0f ? 127.0f : y;
    /* 2 ** y = 2 ** n * 2 ** f, n = rint(y), f in [-1/2, 1/2]: Taylor's series of 2 ** f to the 6th power */
    const float n = rintf(y), f = y - n;
    const float p = 1.0f + f * (0.693147181f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f
                    + f * (0.00133335581f + f * 0.000154035304f)))));
    const float r = p * from_bits((uint32_t)((int32_t)n + 127) << 23);
    return b < 0x00800000 ? 0.0f : r;
}

/* sums[c] += sum_j |x_j - s_c * clamp(rint(x_j / s_c), -z_c, M - z_c)| ** norm over j = 0 .. n - 1 in order, for the
   candidates c = 0 .. cands - 1 (scale s, zero z). The loop over candidates is innermost, so the compiler vectorizes
   it; each candidate's sum is the same whatever the other candidates and the instruction set. */
static inline __attribute__((always_inline)) void add_errors(const float *x, int64_t n, const float *s, const float *z,
                                                             int64_t cands, float max_code, float norm, float *sums)
{
    for (int64_t j = 0; j < n; j++) {
        const float v = x[j];
        for (int64_t c = 0; c < cands; c++) {
            float q = rintf(v / s[c]);
            const float lo = -z[c], hi = max_code - z[c];
            q = q < lo ? lo : q;
            q = q > hi ? hi : q;
            sums[c] += power(v - q * s[c], norm);
        }
    }
}

/* Candidates whose error sums are taken in full first, one vector's worth (AVX-512: 16 floats); the chosen candidate
   is one of them in most groups (the widest ranges: shrink 1 .. 0.85 with the default grid). */
#define FIRST 16
/* The weights of a group whose errors bound each later candidate's sum from below: its largest in magnitude. */
#define PROBES 4

/* Rows [r0, r1) of w [rows, groups * width]; scale and zero [rows, groups, cands] (candidate innermost); max_code M;
   best [rows, groups] receives each (row, group)'s chosen candidate: the first with the smallest sum. `sums` is
   scratch of `cands` floats. `exhaustive`: every candidate's sum in full; else (the same choice, bit for bit) the
   first FIRST candidates' sums in full, the best of them a bound: a later candidate whose errors on the group's PROBES
   largest weights alone (added in the weights' order) exceed it cannot be chosen, since adding the remaining errors
   (none negative) in round-to-nearest never lowers a float sum; those left are summed in full, as exhaustively. Real
   layers leave 2-4 of the 64 later candidates on average (SmolLM2, w4 g64): about a third of the work. */
CLONES void clip_search_int(int64_t r0, int64_t r1, int64_t groups, int64_t width, int64_t cands, const float *w,
                            const float *scale, const float *zero, float max_code, float norm, float *sums,
                            int64_t *best, int64_t exhaustive)
{
    const int prune = !exhaustive && cands > FIRST && width > PROBES;
    /* the later candidates' bounds, and the parameters and sums of those left, padded to whole vectors */
    float bound[prune ? cands : 1], left_s[prune ? cands + FIRST : 1], left_z[prune ? cands + FIRST : 1];
    float left_sums[prune ? cands + FIRST : 1];
    int64_t left_index[prune ? cands : 1];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *x = w + (r * groups + g) * width;
            const float *s = scale + (r * groups + g) * cands, *z = zero + (r * groups + g) * cands;
            if (!prune) {
                for (int64_t c = 0; c < cands; c++)
                    sums[c] = 0.0f;
                add_errors(x, width, s, z, cands, max_code, norm, sums);
                int64_t chosen = 0;
                for (int64_t c = 1; c < cands; c++)  /* strict: ties keep the earlier (wider) range */
                    if (sums[c] < sums[chosen])
                        chosen = c;
                best[r * groups + g] = chosen;
                continue;
            }
            for (int64_t c = 0; c < FIRST; c++)
                sums[c] = 0.0f;
            add_errors(x, width, s, z, FIRST, max_code, norm, sums);
            int64_t chosen = 0;
            for (int64_t c = 1; c < FIRST; c++)
                if (sums[c] < sums[chosen])
                    chosen = c;
            float least = sums[chosen];
            /* the PROBES largest |x_j|, then in the order of j */
            int64_t probe[PROBES];
            int taken = 0;
            for (int64_t j = 0; j < width; j++) {
                int at = taken < PROBES ? taken++ : PROBES;
                while (at > 0 && fabsf(x[j]) > fabsf(x[probe[at - 1]])) {
                    if (at < PROBES)
                        probe[at] = probe[at - 1];
                    at--;
                }
                if (at < PROBES)
                    probe[at] = j;
            }
            for (int a = 1; a < PROBES; a++)
                for (int b = a; b > 0 && probe[b] < probe[b - 1]; b--) {
                    const int64_t t = probe[b];
                    probe[b] = probe[b - 1];
                    probe[b - 1] = t;
                }
            float probes[PROBES];
            for (int a = 0; a < PROBES; a++)
                probes[a] = x[probe[a]];
            const int64_t later = cands - FIRST;
            for (int64_t c = 0; c < later; c++)
                bound[c] = 0.0f;
            add_errors(probes, PROBES, s + FIRST, z + FIRST, later, max_code, norm, bound);
            int64_t left = 0;
            for (int64_t c = 0; c < later; c++)
                if (!(bound[c] > least)) {
                    left_index[left] = FIRST + c;
                    left_s[left] = s[FIRST + c];
                    left_z[left] = z[FIRST + c];
                    left++;
                }
            if (left > 0) {
                const int64_t padded = (left + FIRST - 1) / FIRST * FIRST;  /* whole vectors: a copy of the last */
                for (int64_t c = left; c < padded; c++) {
                    left_s[c] = left_s[left - 1];
                    left_z[c] = left_z[left - 1];
                }
                for (int64_t c = 0; c < padded; c++)
                    left_sums[c] = 0.0f;
                add_errors(x, width, left_s, left_z, padded, max_code, norm, left_sums);
                for (int64_t c = 0; c < left; c++)  /* in candidate order: strict keeps the earlier */
                    if (left_sums[c] < least) {
                        chosen = left_index[c];
                        least = left_sums[c];
                    }
            }
            best[r * groups + g] = chosen;
        }
    }
}
