/* pdpsgd's native CPU noise: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers:
 * as easy as 1, 2, 3", SC'11; the generator torch uses on CUDA and oneMKL offers as
 * VSL_BRNG_PHILOX4X32X10) and the Box-Muller transform, written so that the compiler vectorises it.
 * Built on first use by pdpsgd.native_rng (plain C, no torch headers); called through ctypes.
 *
 * Stream layout (pdpsgd.native_rng documents it; tests/test_native_rng.py checks it against an
 * independent numpy implementation). A stream is a 64-bit key (k0, k1) and a 64-bit nonce (n0, n1);
 * counter j is the 128-bit word (lo32(j), hi32(j), n0, n1). Counters are used in blocks of BLK = 16.
 * float32: block b (counters 16b .. 16b+15, words w0..w3 of each) gives 64 normals, in this order:
 *   [ r(w0) cos(w1) x16, r(w0) sin(w1) x16, r(w2) cos(w3) x16, r(w2) sin(w3) x16 ],
 *   r(x, y) = std * sqrt(-2 ln u1) with a 40-bit uniform u1 = (k 2^16 + l + 1) / 2^40, k = x >> 8,
 *   l = ((x & 255) << 8) | (y & 255); angle 2 pi (y >> 8) / 2^24. Where k = 0 (u1 < 2^-24: |z| > 5.77
 *   std, 1 in 2^24 pairs) u1 = (l 2^24 + (e >> 8) + 1) / 2^64 instead, e the word of counter j under
 *   nonce (n0, n1 ^ TAIL_NONCE) at the pair's position (w0 pair: word 0, w2 pair: word 1), so tails
 *   reach 9.42 std. (Before round 33 u1 = (k + 1) / 2^24: tails ended at 5.77 std, and an output
 *   beyond one dataset's reach but within a neighbour's told them apart; review, round 33.)
 * float64: block b gives 32 normals [ r cos x16, r sin x16 ] with 53-bit uniforms
 *   u1 = (((w0 << 21) ^ (w1 >> 11)) + 1) / 2^53, u2 = ((w2 << 21) ^ (w3 >> 11)) / 2^53.
 * A call of n normals uses ceil(n / per-block) blocks from its first counter; a partial last block's
 * remaining normals are discarded (the caller advances its counter by whole blocks).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define BLK 16
#define PB32 (4 * BLK)
#define PB64 (2 * BLK)
#define TAIL_NONCE 0x9E3779B9u

static void key_schedule(uint32_t k0, uint32_t k1, uint32_t *ka, uint32_t *kb) {
    for (int r = 0; r < 10; r++) { ka[r] = k0; kb[r] = k1; k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
}

#ifdef __AVX2__
#include <immintrin.h>
/* 4 counters per vector, each 32-bit word in a 64-bit lane: _mm256_mul_epu32 is the 32x32->64 product.
 * The block's 16 counters are 4 independent vectors, taken through the rounds together so that the
 * multiplies of one overlap the dependent chain of another (one vector alone waits on its chain). */
#define PH_ROUND(q) do { \
        __m256i p0 = _mm256_mul_epu32(M0, c0[q]), p1 = _mm256_mul_epu32(M1, c2[q]); \
        __m256i m0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c1[q]), K0); \
        __m256i m2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c3[q]), K1); \
        c1[q] = p1; c3[q] = p0; c0[q] = m0; c2[q] = m2; } while (0)
/* the low 32-bit words of two vectors of 4 counters (a: j..j+3, b: j+4..j+7) as 8 words in counter order */
static inline void store_lo(uint32_t *restrict o, __m256i a, __m256i b) {
    const __m256i ORD = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256i ab = _mm256_blend_epi32(a, _mm256_slli_epi64(b, 32), 0xAA);  /* a0 b0 a1 b1 a2 b2 a3 b3 */
    _mm256_storeu_si256((__m256i *)o, _mm256_permutevar8x32_epi32(ab, ORD));
}
static inline void philox_block(uint64_t ctr, uint32_t n0, uint32_t n1, const uint32_t *restrict ka,
                                const uint32_t *restrict kb, uint32_t *restrict o0, uint32_t *restrict o1,
                                uint32_t *restrict o2, uint32_t *restrict o3) {
    const __m256i M0 = _mm256_set1_epi64x(0xD2511F53), M1 = _mm256_set1_epi64x(0xCD9E8D57);
    const __m256i LO = _mm256_set1_epi64x(0xFFFFFFFF);
    __m256i c0[4], c1[4], c2[4], c3[4];
    for (int q = 0; q < 4; q++) {
        int j = 4 * q;
        __m256i c = _mm256_add_epi64(_mm256_set1_epi64x((long long)ctr), _mm256_set_epi64x(j + 3, j + 2, j + 1, j));
        c0[q] = _mm256_and_si256(c, LO); c1[q] = _mm256_srli_epi64(c, 32);
        c2[q] = _mm256_set1_epi64x(n0); c3[q] = _mm256_set1_epi64x(n1);
    }
    for (int r = 0; r < 10; r++) {
        const __m256i K0 = _mm256_set1_epi64x(ka[r]), K1 = _mm256_set1_epi64x(kb[r]);
        PH_ROUND(0); PH_ROUND(1); PH_ROUND(2); PH_ROUND(3);
    }
    for (int h = 0; h < 2; h++) {  /* c1, c3: only their low 32 bits are words */
        store_lo(o0 + 8 * h, c0[2 * h], c0[2 * h + 1]); store_lo(o1 + 8 * h, c1[2 * h], c1[2 * h + 1]);
        store_lo(o2 + 8 * h, c2[2 * h], c2[2 * h + 1]); store_lo(o3 + 8 * h, c3[2 * h], c3[2 * h + 1]);
    }
}
#else
static inline void philox_block(uint64_t ctr, uint32_t n0, uint32_t n1, const uint32_t *restrict ka,
                                const uint32_t *restrict kb, uint32_t *restrict o0, uint32_t *restrict o1,
                                uint32_t *restrict o2, uint32_t *restrict o3) {
    for (int j = 0; j < BLK; j++) {
        uint64_t c = ctr + (uint64_t)j;
        uint32_t c0 = (uint32_t)c, c1 = (uint32_t)(c >> 32), c2 = n0, c3 = n1;
        for (int r = 0; r < 10; r++) {
            uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
            uint32_t m0 = (uint32_t)(p1 >> 32) ^ c1 ^ ka[r], m2 = (uint32_t)(p0 >> 32) ^ c3 ^ kb[r];
            c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = m0; c2 = m2;
        }
        o0[j] = c0; o1[j] = c1; o2[j] = c2; o3[j] = c3;
    }
}
#endif

static inline float f_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t u_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ln x for normal positive float32 x (here x in [2^-24, 1]): x = m 2^e, m in [sqrt(1/2), sqrt(2)),
 * Cephes' logf polynomial in m - 1; branch-free so the loop vectorises. */
static inline float log_f32(float x) {
    uint32_t b = u_of(x);
    float e = (float)((int32_t)(b >> 23) - 126);
    float m = f_of((b & 0x007FFFFFu) | 0x3F000000u);           /* [0.5, 1) */
    uint32_t lo = 0u - (uint32_t)(m < 0.707106781186547524f);   /* all ones where m < sqrt(1/2) */
    e -= f_of(lo & 0x3F800000u);                               /* 1.0f there, else 0 */
    m = m + f_of(u_of(m) & lo) - 1.0f;                         /* 2m - 1 there, else m - 1 */
    float z = m * m;
    float y = 7.0376836292E-2f;
    y = y * m - 1.1514610310E-1f;
    y = y * m + 1.1676998740E-1f;
    y = y * m - 1.2420140846E-1f;
    y = y * m + 1.4249322787E-1f;
    y = y * m - 1.6668057665E-1f;
    y = y * m + 2.0000714765E-1f;
    y = y * m - 2.4999993993E-1f;
    y = y * m + 3.3333331174E-1f;
    y = y * m * z;
    y += e * -2.12194440e-4f;
    y += -0.5f * z;
    return m + y + e * 0.693359375f;
}

/* cos and sin of 2 pi k / 2^24, k < 2^24: the nearest quarter turn q exactly from k's bits, the
 * remainder x in [-pi/4, pi/4) through Cephes' sinf/cosf polynomials, then rotated by q. */
static inline void sincos_turns24(uint32_t k, float *c, float *s) {
    uint32_t qk = (k + (1u << 21)) >> 22;                       /* 0..4 */
    uint32_t q = qk & 3u;
    float x = (float)(int32_t)(k - (qk << 22)) * (6.2831853071795864769f / 16777216.0f);
    float z = x * x;
    float sp = ((-1.9515295891E-4f * z + 8.3321608736E-3f) * z - 1.6666654611E-1f) * z * x + x;
    float cp = ((2.443315711809948E-5f * z - 1.388731625493765E-3f) * z + 4.166664568298827E-2f) * z * z
               - 0.5f * z + 1.0f;
    uint32_t sw = 0u - (q & 1u);                                /* odd quadrant: cos <-> sin */
    uint32_t cc = (u_of(sp) & sw) | (u_of(cp) & ~sw), ss = (u_of(cp) & sw) | (u_of(sp) & ~sw);
    *c = f_of(cc ^ (((q + 1u) & 2u) << 30));                   /* q = 1, 2: cos < 0 */
    *s = f_of(ss ^ ((q & 2u) << 30));                           /* q = 2, 3: sin < 0 */
}

/* the 16 low bits of the 40-bit radius uniform: x's low 8 bits, then y's (y's high 24: the angle) */
static inline uint32_t low16(uint32_t x, uint32_t y) { return ((x & 255u) << 8) | (y & 255u); }

static inline void box_muller_f32(const uint32_t *restrict x, const uint32_t *restrict y, float *restrict oc,
                                  float *restrict os, float std, int n) {
    for (int j = 0; j < n; j++) {
        /* (k 2^16 + l + 1) / 2^40 rounded to float32: k 2^-24 exact, (l + 1) 2^-40 exact */
        float u1 = (float)(int32_t)(x[j] >> 8) * (1.0f / 16777216.0f)
                   + (float)(int32_t)(low16(x[j], y[j]) + 1u) * (1.0f / 1099511627776.0f);
        float r = sqrtf(-2.0f * log_f32(u1)) * std;
        float c, s;
        sincos_turns24(y[j] >> 8, &c, &s);
        oc[j] = r * c;
        os[j] = r * s;
    }
}

/* a pair whose k = x >> 8 is 0 (u1 < 2^-24), again with u1 = (l 2^24 + (e >> 8) + 1) / 2^64 */
static void tail_f32(uint32_t x, uint32_t y, uint32_t e, float *c, float *s, float std) {
    float u1 = (float)(int32_t)low16(x, y) * (1.0f / 1099511627776.0f)
               + (float)(int32_t)((e >> 8) + 1u) * (1.0f / 18446744073709551616.0f);
    float r = sqrtf(-2.0f * log_f32(u1)) * std, cc, ss;
    sincos_turns24(y >> 8, &cc, &ss);
    *c = r * cc;
    *s = r * ss;
}

/* the transform alone, on given words, e the tail words (tests feed it every input class) */
void pdpsgd_box_muller_f32(const uint32_t *x, const uint32_t *y, const uint32_t *e, float *oc, float *os, int64_t n,
                           float std) {
    for (int64_t i = 0; i < n; i += BLK) {
        int m = (int)((n - i) < BLK ? (n - i) : BLK);
        box_muller_f32(x + i, y + i, oc + i, os + i, std, m);
    }
    for (int64_t i = 0; i < n; i++)
        if (x[i] < 256u) tail_f32(x[i], y[i], e[i], oc + i, os + i, std);
}

/* raw Philox words of nblk blocks: out[(16 b + j) * 4 + w] = word w of counter ctr + 16 b + j */
void pdpsgd_philox_raw(uint32_t *out, int64_t nblk, uint64_t ctr, uint32_t k0, uint32_t k1, uint32_t n0,
                       uint32_t n1) {
    uint32_t ka[10], kb[10], w0[BLK], w1[BLK], w2[BLK], w3[BLK];
    key_schedule(k0, k1, ka, kb);
    for (int64_t b = 0; b < nblk; b++, ctr += BLK) {
        philox_block(ctr, n0, n1, ka, kb, w0, w1, w2, w3);
        for (int j = 0; j < BLK; j++) {
            uint32_t *p = out + (b * BLK + j) * 4;
            p[0] = w0[j]; p[1] = w1[j]; p[2] = w2[j]; p[3] = w3[j];
        }
    }
}

static inline void block_f32(uint64_t ctr, uint32_t n0, uint32_t n1, const uint32_t *ka, const uint32_t *kb,
                             float *o, float std) {
    uint32_t w0[BLK], w1[BLK], w2[BLK], w3[BLK];
    philox_block(ctr, n0, n1, ka, kb, w0, w1, w2, w3);
    box_muller_f32(w0, w1, o, o + BLK, std, BLK);
    box_muller_f32(w2, w3, o + 2 * BLK, o + 3 * BLK, std, BLK);
    uint32_t tail = 0;
    for (int j = 0; j < BLK; j++) tail |= (uint32_t)(w0[j] < 256u) | (uint32_t)(w2[j] < 256u);
    if (tail) {  /* 1 in 2^23 blocks: the tail words of the counters that need them */
        for (int j = 0; j < BLK; j++) {
            if (w0[j] >= 256u && w2[j] >= 256u) continue;
            uint32_t e0[BLK], e1[BLK], e2[BLK], e3[BLK];
            philox_block(ctr + (uint64_t)j, n0, n1 ^ TAIL_NONCE, ka, kb, e0, e1, e2, e3);  /* lane 0: counter ctr + j */
            if (w0[j] < 256u) tail_f32(w0[j], w1[j], e0[0], o + j, o + BLK + j, std);
            if (w2[j] < 256u) tail_f32(w2[j], w3[j], e1[0], o + 2 * BLK + j, o + 3 * BLK + j, std);
        }
    }
}

/* out[i] = z_i (add == 0) or out[i] = out[i] * scale + z_i (add != 0), z_i ~ N(0, std^2), i < n;
 * returns the number of counters used */
int64_t pdpsgd_normal_f32(float *out, int64_t n, uint64_t ctr, uint32_t k0, uint32_t k1, uint32_t n0, uint32_t n1,
                          float std, int add, float scale) {
    uint32_t ka[10], kb[10];
    float z[PB32];
    key_schedule(k0, k1, ka, kb);
    uint64_t c = ctr;
    for (int64_t i = 0; i < n; i += PB32, c += BLK) {
        int64_t m = (n - i) < PB32 ? (n - i) : PB32;
        if (!add && m == PB32) { block_f32(c, n0, n1, ka, kb, out + i, std); continue; }
        block_f32(c, n0, n1, ka, kb, z, std);
        if (add) { for (int64_t j = 0; j < m; j++) out[i + j] = out[i + j] * scale + z[j]; }
        else memcpy(out + i, z, (size_t)m * sizeof(float));
    }
    return (int64_t)(c - ctr);
}

/* The first counter of each of count buffers of ns[i] normals taken in turn from ctr, per whole
 * blocks of per normals (starts[count]: where the last one ends). */
static void piece_starts(const int64_t *ns, int64_t count, uint64_t ctr, int64_t per, uint64_t *starts) {
    for (int64_t i = 0; i < count; i++) { starts[i] = ctr; ctr += (uint64_t)((ns[i] + per - 1) / per) * BLK; }
    starts[count] = ctr;
}

/* NAME: ONE (pdpsgd_normal_f32 / _f64) over count buffers in turn, each starting where the previous
 * one's counters ended: the same draws as count successive calls, in one call (no per-buffer
 * foreign-call cost). nthreads > 1 (a build with OpenMP): the buffers are shared among that many
 * threads; each buffer's first counter is fixed beforehand, so the draws are the same bits for any
 * thread count. Returns the number of counters used in all, or -1 if a buffer's count disagreed. */
#define DEFINE_MANY(NAME, ONE, T, PER) \
    int64_t NAME(T *const *outs, const int64_t *ns, int64_t count, uint64_t ctr, uint32_t k0, uint32_t k1, \
                 uint32_t n0, uint32_t n1, T std, int add, T scale, int nthreads) { \
        uint64_t *starts = (uint64_t *)malloc((size_t)(count + 1) * sizeof(uint64_t)); \
        if (!starts) return -1; \
        piece_starts(ns, count, ctr, PER, starts); \
        int64_t bad = 0; \
        (void)nthreads; \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1) reduction(+ : bad)") \
        for (int64_t i = 0; i < count; i++) \
            bad += ONE(outs[i], ns[i], starts[i], k0, k1, n0, n1, std, add, scale) \
                   != (int64_t)(starts[i + 1] - starts[i]); \
        int64_t used = (int64_t)(starts[count] - ctr); \
        free(starts); \
        return bad ? -1 : used; \
    }

DEFINE_MANY(pdpsgd_normal_f32_many, pdpsgd_normal_f32, float, PB32)

/* float64: 53-bit uniforms from two words each, libm's log/cos/sin in double (not vectorised: the
 * float64 path is for exactness tests, not speed); same contract as pdpsgd_normal_f32 */
int64_t pdpsgd_normal_f64(double *out, int64_t n, uint64_t ctr, uint32_t k0, uint32_t k1, uint32_t n0, uint32_t n1,
                          double std, int add, double scale) {
    uint32_t ka[10], kb[10], w0[BLK], w1[BLK], w2[BLK], w3[BLK];
    double z[PB64];
    const double s53 = 1.0 / 9007199254740992.0, twopi = 6.283185307179586476925286766559;
    key_schedule(k0, k1, ka, kb);
    uint64_t c = ctr;
    for (int64_t i = 0; i < n; i += PB64, c += BLK) {
        philox_block(c, n0, n1, ka, kb, w0, w1, w2, w3);
        for (int j = 0; j < BLK; j++) {
            uint64_t a = ((uint64_t)w0[j] << 21) ^ (uint64_t)(w1[j] >> 11);
            uint64_t b = ((uint64_t)w2[j] << 21) ^ (uint64_t)(w3[j] >> 11);
            double r = std * sqrt(-2.0 * log((double)(a + 1u) * s53));
            double t = twopi * ((double)b * s53);
            z[j] = r * cos(t);
            z[BLK + j] = r * sin(t);
        }
        int64_t m = (n - i) < PB64 ? (n - i) : PB64;
        if (add) { for (int64_t j = 0; j < m; j++) out[i + j] = out[i + j] * scale + z[j]; }
        else memcpy(out + i, z, (size_t)m * sizeof(double));
    }
    return (int64_t)(c - ctr);
}

/* pdpsgd_normal_f64 over count buffers in turn (as pdpsgd_normal_f32_many) */
DEFINE_MANY(pdpsgd_normal_f64_many, pdpsgd_normal_f64, double, PB64)
