/* The CPU kernels of tailrace's engine decode step (built by tailrace/engine/ckernel.py with the system C
   compiler; no torch headers):
   - decode attention: one query token per sequence, read in place from the engine's paged KV cache
     (blocks, Hkv, block_size, D), fp32 or bf16, each sequence attending to exactly its own length over
     the blocks its block-table row lists;
   - a decode layer's whole attention block after the q/k/v projection (RoPE, both cache writes,
     attention) in one call;
   - RMSNorm and SiLU-and-multiply, the elementwise ops between the GEMMs;
   - the LoRA terms of a batch whose rows belong to different adapters (one call per fused projection);
   - sampling: the engine sampler's Gumbel noise (tailrace/engine/sampler.py: the same counter-based
     hash) and, for rows without top-k/top-p or banned stop tokens, the whole draw (argmax of tempered
     logits + noise) with the log-softmax logprob of the drawn token.

   Why: as batched GEMMs (torch.bmm) attention reads every row up to the longest row of its chunk, builds a
   mask, runs softmax as separate passes and (bf16) copies strided cache views (its share of a decode step:
   bench/README.md). Here each (row, kv head) reads its K and V once for all G query heads that share
   them, in fp32 arithmetic, with the softmax in between; and each small torch op the kernels replace
   costs more in dispatch than in arithmetic at these sizes. */
#include <stdint.h>
#include <string.h>
#include <math.h>

/* One element as fp32 / back to the storage type: bf16 is the top half of an fp32 (widening is a shift),
   rounded to nearest even on the way back (as torch), NaN kept NaN. */
static inline float f32_in(float x) { return x; }
static inline float f32_out(float x) { return x; }
static inline float bf16_in(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t bf16_out(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Gemma 2's softcap of n scores: s = cap tanh(s / cap) (monotonic: the max of the capped scores is the
   capped max). */
static void softcap(float *restrict s, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
}

/* A bf16 cache row widened into buf as fp32. */
static inline const float *widen_bf16(float *restrict buf, const uint16_t *restrict x, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) buf[d] = bf16_in(x[d]);
    return buf;
}

/* e^x for x in [-87, 88] (clamped outside): Cody-Waite reduction to |r| <= ln2/2, degree-6 Taylor
   polynomial, relative error ~1e-7 (float rounding); inlines into vectorized loops. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float t = x * 1.44269504088896341f;
    const float fn = (t + 12582912.0f) - 12582912.0f;
    const float r = x - fn * 0.693145751953125f - fn * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)fn + 127) << 23;
    float sc; memcpy(&sc, &e, 4);
    return p * sc;
}

/* s[i] = exp(s[i] - m) for s[i] <= m; returns the sum. */
static float exp_shift_sum(float *restrict s, int64_t n, float m) {
    float sum = 0.f;
#pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++) {
        const float y = exp_poly(s[i] - m);
        s[i] = y;
        sum += y;
    }
    return sum;
}

/* The blocks of one (sequence, kv head): positions [b bs, (b + 1) bs) of its K (V) are the bs rows of D
   at k (v) + tb[b] * bstride, where k and v already point at the kv head within a block. Every head
   function below visits positions in order, block by block, doing per position exactly what it would do
   over one contiguous row (so results do not depend on the block size or on where the blocks lie). */
#define BLOCKS const int32_t *restrict tb, int64_t bs, int64_t bstride
#define BLOCK_AT(p, b) ((p) + (int64_t)tb[b] * bstride)

/* One (sequence, kv head): G query heads of D over n cached positions, the first n0 of them outside its
   window (scored, but weighted 0: left out of the max and the softmax), the scores capped where cap > 0
   (`softcap`), written to oh (G, D); DD > 0: D
   known at compile time. fp32 cache: one head at a time (g outer), its query in registers; the G heads of
   a kv head re-read the same K/V rows from L1. s holds n scores. Measured faster than t outer for fp32. */
#define HEAD_G_OUTER(NAME, DD)                                                                       \
static void NAME(const float *restrict qh, const float *restrict k, const float *restrict v, BLOCKS, \
                 int64_t n, int64_t n0, int64_t G, int64_t D_, float scale, float cap, float *restrict s,           \
                 float *restrict oh) { \
    const int64_t D = DD ? DD : D_;                                                                  \
    for (int64_t g = 0; g < G; g++) {                                                                \
        const float *qg = qh + g * D;                                                                \
        float mx = -INFINITY;                                                                        \
        for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, b++) {                                         \
            const float *kb = BLOCK_AT(k, b);                                                        \
            const int64_t m = n - t0 < bs ? n - t0 : bs;                                             \
            for (int64_t t = 0; t < m; t++) {                                                        \
                const float *kt = kb + t * D;                                                        \
                float acc = 0.f;                                                                     \
                _Pragma("omp simd reduction(+:acc)")                                                 \
                for (int64_t d = 0; d < D; d++) acc += qg[d] * kt[d];                                \
                acc *= scale;                                                                        \
                s[t0 + t] = acc;                                                                     \
                mx = acc > mx && t0 + t >= n0 ? acc : mx;                                            \
            }                                                                                        \
        }                                                                                            \
        if (cap > 0.f) {                                                                             \
            softcap(s, n, cap);                                                                      \
            mx = cap * tanhf(mx / cap);                                                              \
        }                                                                                            \
        const float inv = 1.0f / exp_shift_sum(s + n0, n - n0, mx);                                  \
        for (int64_t t = 0; t < n0; t++) s[t] = 0.f;                                                 \
        float o[DD ? DD : 256];                                                                      \
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;                                                  \
        for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, b++) {                                         \
            const float *vb = BLOCK_AT(v, b);                                                        \
            const int64_t m = n - t0 < bs ? n - t0 : bs;                                             \
            for (int64_t t = 0; t < m; t++) {                                                        \
                const float *vt = vb + t * D;                                                        \
                const float w = s[t0 + t];                                                           \
                _Pragma("omp simd")                                                                  \
                for (int64_t d = 0; d < D; d++) o[d] += w * vt[d];                                   \
            }                                                                                        \
        }                                                                                            \
        float *og = oh + g * D;                                                                      \
        for (int64_t d = 0; d < D; d++) og[d] = o[d] * inv;                                          \
    }                                                                                                \
}

/* bf16 cache: each K and V row is widened once for all G heads (t outer); s holds G x n scores. */
#define HEAD_T_OUTER(NAME, KT, WIDEN, DD)                                                                  \
static void NAME(const float *restrict qh, const KT *restrict k, const KT *restrict v, BLOCKS,       \
                 int64_t n, int64_t n0, int64_t G, int64_t D_, float scale, float cap, float *restrict s,           \
                 float *restrict oh) { \
    const int64_t D = DD ? DD : D_;                                                                  \
    float row[DD ? DD : 256];                                                                        \
    for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, b++) {                                             \
        const KT *kb = BLOCK_AT(k, b);                                                               \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                                 \
        for (int64_t i = 0; i < m; i++) {                                                            \
            const float *kt = WIDEN(row, kb + i * D, D);                                             \
            for (int64_t g = 0; g < G; g++) {                                                        \
                const float *qg = qh + g * D;                                                        \
                float acc = 0.f;                                                                     \
                _Pragma("omp simd reduction(+:acc)")                                                 \
                for (int64_t d = 0; d < D; d++) acc += qg[d] * kt[d];                                \
                s[g * n + t0 + i] = acc * scale;                                                     \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    if (cap > 0.f) softcap(s, G * n, cap);                                                           \
    for (int64_t g = 0; g < G; g++) {                                                                \
        float *sg = s + g * n, mx = -INFINITY;                                                       \
        for (int64_t t = n0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;                               \
        const float inv = 1.0f / exp_shift_sum(sg + n0, n - n0, mx);                                 \
        for (int64_t t = 0; t < n0; t++) sg[t] = 0.f;                                                \
        for (int64_t t = 0; t < n; t++) sg[t] *= inv;                                                \
    }                                                                                                \
    for (int64_t i = 0; i < G * D; i++) oh[i] = 0.f;                                                 \
    for (int64_t t0 = 0, b = 0; t0 < n; t0 += bs, b++) {                                             \
        const KT *vb = BLOCK_AT(v, b);                                                               \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                                 \
        for (int64_t i = 0; i < m; i++) {                                                            \
            const float *vt = WIDEN(row, vb + i * D, D);                                             \
            for (int64_t g = 0; g < G; g++) {                                                        \
                const float w = s[g * n + t0 + i];                                                   \
                float *og = oh + g * D;                                                              \
                _Pragma("omp simd")                                                                  \
                for (int64_t d = 0; d < D; d++) og[d] += w * vt[d];                                  \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}

HEAD_G_OUTER(h_f32_32, 32)
HEAD_G_OUTER(h_f32_64, 64)
HEAD_G_OUTER(h_f32_128, 128)
HEAD_G_OUTER(h_f32_any, 0)
HEAD_T_OUTER(h_bf16_32, uint16_t, widen_bf16, 32)
HEAD_T_OUTER(h_bf16_64, uint16_t, widen_bf16, 64)
HEAD_T_OUTER(h_bf16_128, uint16_t, widen_bf16, 128)
HEAD_T_OUTER(h_bf16_any, uint16_t, widen_bf16, 0)


#if defined(__AVX512F__)
/* AVX-512, D a multiple of 16. Scores: blocks of 8 positions, up to three query heads at a time, each K
   row loaded once for all of them; the 8 dot products' lanes are summed by one transposing reduction
   (hsum8) instead of one horizontal reduction per position. Values: each V row loaded once per group. */
#include <immintrin.h>

static inline __m512 ld_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 ld_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* The horizontal sums of 8 vectors, as one vector of 8. */
static inline __m256 hsum8(const __m512 *a) {
    __m256 b[8];
    for (int i = 0; i < 8; i++)
        b[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    const __m256 t01 = _mm256_hadd_ps(b[0], b[1]), t23 = _mm256_hadd_ps(b[2], b[3]);
    const __m256 t45 = _mm256_hadd_ps(b[4], b[5]), t67 = _mm256_hadd_ps(b[6], b[7]);
    const __m256 u0 = _mm256_hadd_ps(t01, t23), u1 = _mm256_hadd_ps(t45, t67);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* NQ (1-3) query heads of one kv head at once: each K and V row is loaded once for all of them. Per head
   the arithmetic is the same whatever NQ (each score an 8-position fmadd chain and hsum8), so results do
   not depend on how the heads are grouped. */
#define HEAD_AVX512(NAME, KT, LD, DD)                                                                \
static inline __attribute__((always_inline)) void NAME##_q(                                          \
    const float *restrict qh, const KT *restrict k, const KT *restrict v, BLOCKS, int64_t n,         \
    int64_t n0, int64_t D, float scale, float cap, float *restrict s, float *restrict oh, const int NQ) { \
    const int64_t C = D / 16;                                                                        \
    const __m256 sc = _mm256_set1_ps(scale);                                                         \
    for (int64_t t0 = 0, bk = 0; t0 < n; t0 += bs, bk++) {                                           \
        const KT *kb = BLOCK_AT(k, bk);                                                              \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                                 \
        int64_t t = 0;                                                                               \
        for (; t + 8 <= m; t += 8) {                                                                 \
            __m512 a[3][8];                                                                          \
            for (int q = 0; q < NQ; q++)                                                             \
                for (int i = 0; i < 8; i++) a[q][i] = _mm512_setzero_ps();                           \
            for (int64_t c = 0; c < C; c++) {                                                        \
                __m512 x[3];                                                                         \
                for (int q = 0; q < NQ; q++) x[q] = _mm512_loadu_ps(qh + q * D + 16 * c);            \
                for (int i = 0; i < 8; i++) {                                                        \
                    const __m512 kv = LD(kb + (t + i) * D + 16 * c);                                 \
                    for (int q = 0; q < NQ; q++) a[q][i] = _mm512_fmadd_ps(x[q], kv, a[q][i]);       \
                }                                                                                    \
            }                                                                                        \
            for (int q = 0; q < NQ; q++) _mm256_storeu_ps(s + q * n + t0 + t, _mm256_mul_ps(hsum8(a[q]), sc)); \
        }                                                                                            \
        for (; t < m; t++) {                                                                         \
            __m512 a[3];                                                                             \
            for (int q = 0; q < NQ; q++) a[q] = _mm512_setzero_ps();                                 \
            for (int64_t c = 0; c < C; c++) {                                                        \
                const __m512 kv = LD(kb + t * D + 16 * c);                                           \
                for (int q = 0; q < NQ; q++)                                                         \
                    a[q] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + q * D + 16 * c), kv, a[q]);          \
            }                                                                                        \
            for (int q = 0; q < NQ; q++) s[q * n + t0 + t] = _mm512_reduce_add_ps(a[q]) * scale;     \
        }                                                                                            \
    }                                                                                                \
    float inv[3];                                                                                    \
    if (cap > 0.f)                                                                                   \
        for (int q = 0; q < NQ; q++) softcap(s + q * n, n, cap);                                    \
    for (int q = 0; q < NQ; q++) {                                                                   \
        float *sq = s + q * n, mx = -INFINITY;                                                       \
        for (int64_t i = n0; i < n; i++) mx = sq[i] > mx ? sq[i] : mx;                               \
        inv[q] = 1.0f / exp_shift_sum(sq + n0, n - n0, mx);                                          \
        for (int64_t i = 0; i < n0; i++) sq[i] = 0.f;                                                \
    }                                                                                                \
    __m512 o[3][DD ? DD / 16 : 16];                                                                  \
    for (int q = 0; q < NQ; q++)                                                                     \
        for (int64_t c = 0; c < C; c++) o[q][c] = _mm512_setzero_ps();                               \
    for (int64_t t0 = 0, bk = 0; t0 < n; t0 += bs, bk++) {                                           \
        const KT *vb = BLOCK_AT(v, bk);                                                              \
        const int64_t m = n - t0 < bs ? n - t0 : bs;                                                 \
        for (int64_t u = 0; u < m; u++) {                                                            \
            __m512 w[3];                                                                             \
            for (int q = 0; q < NQ; q++) w[q] = _mm512_set1_ps(s[q * n + t0 + u]);                   \
            for (int64_t c = 0; c < C; c++) {                                                        \
                const __m512 vv = LD(vb + u * D + 16 * c);                                           \
                for (int q = 0; q < NQ; q++) o[q][c] = _mm512_fmadd_ps(w[q], vv, o[q][c]);           \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int q = 0; q < NQ; q++) {                                                                   \
        const __m512 vi = _mm512_set1_ps(inv[q]);                                                    \
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(oh + q * D + 16 * c, _mm512_mul_ps(o[q][c], vi)); \
    }                                                                                                \
}                                                                                                    \
/* The G heads in groups of 3 (a pair or a single last; 4 as two pairs). */                          \
static void NAME(const float *restrict qh, const KT *restrict k, const KT *restrict v, BLOCKS,       \
                 int64_t n, int64_t n0, int64_t G, int64_t D_, float scale, float cap, float *restrict s,           \
                 float *restrict oh) { \
    const int64_t D = DD ? DD : D_;                                                                  \
    for (int64_t g0 = 0; g0 < G;) {                                                                  \
        const int64_t r = G - g0, nq = r == 4 ? 2 : r >= 3 ? 3 : r;                                  \
        const float *q = qh + g0 * D;                                                                \
        float *sg = s + g0 * n, *og = oh + g0 * D;                                                   \
        if (nq == 3) NAME##_q(q, k, v, tb, bs, bstride, n, n0, D, scale, cap, sg, og, 3);                     \
        else if (nq == 2) NAME##_q(q, k, v, tb, bs, bstride, n, n0, D, scale, cap, sg, og, 2);                \
        else NAME##_q(q, k, v, tb, bs, bstride, n, n0, D, scale, cap, sg, og, 1);                             \
        g0 += nq;                                                                                    \
    }                                                                                                \
}

HEAD_AVX512(x_f32_32, float, ld_f32, 32)
HEAD_AVX512(x_f32_64, float, ld_f32, 64)
HEAD_AVX512(x_f32_128, float, ld_f32, 128)
HEAD_AVX512(x_f32_any, float, ld_f32, 0)
HEAD_AVX512(x_bf16_32, uint16_t, ld_bf16, 32)
HEAD_AVX512(x_bf16_64, uint16_t, ld_bf16, 64)
HEAD_AVX512(x_bf16_128, uint16_t, ld_bf16, 128)
HEAD_AVX512(x_bf16_any, uint16_t, ld_bf16, 0)
#endif

/* One (sequence, kv head): the AVX-512 path where D is a multiple of 16, else the portable one; each with
   its compiled-in head dims. */
#define BY_HEAD_DIM(P) \
    do { \
        if (D == 32) P##_32(qh, k, v, tb, bs, bstride, n, n0, G, D, scale, cap, s, oh); \
        else if (D == 64) P##_64(qh, k, v, tb, bs, bstride, n, n0, G, D, scale, cap, s, oh); \
        else if (D == 128) P##_128(qh, k, v, tb, bs, bstride, n, n0, G, D, scale, cap, s, oh); \
        else P##_any(qh, k, v, tb, bs, bstride, n, n0, G, D, scale, cap, s, oh); \
    } while (0)
static void attend_f32(const float *qh, const float *k, const float *v, BLOCKS, int64_t n, int64_t n0,
                       int64_t G, int64_t D, float scale, float cap, float *s, float *oh) {
#if defined(__AVX512F__)
    if (D % 16 == 0) { BY_HEAD_DIM(x_f32); return; }
#endif
    BY_HEAD_DIM(h_f32);
}
static void attend_bf16(const float *qh, const uint16_t *k, const uint16_t *v, BLOCKS, int64_t n,
                        int64_t n0, int64_t G, int64_t D, float scale, float cap, float *s, float *oh) {
#if defined(__AVX512F__)
    if (D % 16 == 0) { BY_HEAD_DIM(x_bf16); return; }
#endif
    BY_HEAD_DIM(h_bf16);
}

/* -- the paged cache: k, v (blocks, Hkv, bs, D); block table tbl (rows, W) int32, row r's positions
   [b bs, (b + 1) bs) in block tbl[r W + b] ------------------------------------------------------------ */

/* Every token t of a call reads table row rw[t] (row0 + t when rw is NULL) and positions [0, pos[t]]:
   0 when the row, the position and the blocks holding [0, pos[t]] all lie in the cache, else -2 (a
   position outside [0, W bs)), -3 (a row outside [0, rows)) or -4 (a block outside [0, nblocks)).
   Checked for all tokens before anything is read or written. */
static int check_tokens(const int64_t *rw, int64_t row0, const int64_t *pos, int64_t M, const int32_t *tbl,
                        int64_t rows, int64_t W, int64_t bs, int64_t nblocks) {
    for (int64_t t = 0; t < M; t++) {
        const int64_t r = rw ? rw[t] : row0 + t, p = pos[t];
        if (p < 0 || p >= W * bs) return -2;
        if (r < 0 || r >= rows) return -3;
        const int32_t *tb = tbl + r * W;
        for (int64_t b = 0; b <= p / bs; b++)
            if (tb[b] < 0 || tb[b] >= nblocks) return -4;
    }
    return 0;
}

#ifndef PF_AHEAD
#define PF_AHEAD 1
#endif
#ifndef PF_LOC
#define PF_LOC 2
#endif
/* Prefetch the K and V of kv head h, positions [0, p], of the sequence whose table row is tb (checked). */
#define PREFETCH(KT, tb, h, p)                                                                           \
    do {                                                                                                 \
        const int64_t np = (p) + 1;                                                                      \
        for (int64_t t0 = 0, b_ = 0; t0 < np; t0 += bs, b_++) {                                         \
            const int64_t nn = (np - t0 < bs ? np - t0 : bs) * D * (int64_t)sizeof(KT);                 \
            const int64_t at = ((int64_t)(tb)[b_] * Hkv + (h)) * bs * D;                                \
            const char *pk = (const char *)(k + at), *pv = (const char *)(v + at);                      \
            for (int64_t o = 0; o < nn; o += 64) {                                                      \
                __builtin_prefetch(pk + o, 0, PF_LOC);                                                  \
                __builtin_prefetch(pv + o, 0, PF_LOC);                                                  \
            }                                                                                            \
        }                                                                                                \
    } while (0)

/* A sliding window: a token at position p attends to positions [WINDOW_START(p, w), p], the last w
   (w = 0: all). The attention functions skip the whole blocks before that start and are told how many
   positions of the first block they read lie before it (n0: scored, but left out of the softmax). */
#define WINDOW_START(p, w) ((w) > 0 && (p) + 1 > (w) ? (p) + 1 - (w) : 0)

/* q (B, Hkv, G, D) fp32; sequence b reads table row row0 + b, positions [0, pos[b]] (the last `window` of
   them where window > 0); out (B, Hkv, G, D) fp32; scratch >= G W bs floats. Returns 0, -1 (D > 256) or check_tokens' code. The (sequence, head)
   PF_AHEAD ahead is prefetched (into L2) while one is computed. */
#define DRIVER(NAME, KT, ATTEND)                                                                     \
int NAME(const float *restrict q, const KT *restrict k, const KT *restrict v,                         \
         const int32_t *restrict tbl, const int64_t *restrict pos, float *restrict out, int64_t B,     \
         int64_t Hkv, int64_t G, int64_t D, int64_t row0, int64_t rows, int64_t W, int64_t bs,       \
         int64_t nblocks, float scale, float *restrict scratch, int64_t window, float cap) {         \
    if (D > 256) return -1;                                                                          \
    const int rc = check_tokens(NULL, row0, pos, B, tbl, rows, W, bs, nblocks);                      \
    if (rc) return rc;                                                                               \
    const int64_t J = B * Hkv, bstride = Hkv * bs * D;                                               \
    for (int64_t j = 0; j < PF_AHEAD && j < J; j++)                                                  \
        PREFETCH(KT, tbl + (row0 + j / Hkv) * W, j % Hkv, pos[j / Hkv]);                              \
    for (int64_t j = 0; j < J; j++) {                                                                \
        const int64_t b = j / Hkv, h = j % Hkv;                                                      \
        if (j + PF_AHEAD < J) {                                                                      \
            const int64_t a = j + PF_AHEAD;                                                          \
            PREFETCH(KT, tbl + (row0 + a / Hkv) * W, a % Hkv, pos[a / Hkv]);                          \
        }                                                                                            \
        const int64_t lo = WINDOW_START(pos[b], window), bk = lo / bs;                               \
        ATTEND(q + j * G * D, k + h * bs * D, v + h * bs * D, tbl + (row0 + b) * W + bk, bs, bstride, \
               pos[b] + 1 - bk * bs, lo - bk * bs, G, D, scale, cap, scratch, out + j * G * D);      \
    }                                                                                                \
    return 0;                                                                                        \
}
DRIVER(decode_attn_f32, float, attend_f32)
DRIVER(decode_attn_bf16, uint16_t, attend_bf16)

/* y = w * NORMED(x / sqrt(mean(x^2) + eps)) over D values (a row: RMSNorm; a head's q or k: Qwen3's
   q/k norms), the mean in fp32, the product rounded to T. NORMED: ROUNDED_BF16 for HF's RMSNorm in
   bf16 (the normalized value rounded to T before the weight: both products rounded), AS_IS for fp32
   and for OLMo2's bf16 norm (scaled in fp32, rounded once). The weights are of type WT, read by WIN (T's
   own, or Gemma's fp32 1 + w beside a bf16 row). Returns y. */
#define AS_IS(v) (v)
#define ROUNDED_BF16(v) bf16_in(bf16_out(v))
#define HEAD_NORM(NAME, T, IN, OUT, NORMED, WT, WIN)                                                    \
static inline const T *NAME(const T *restrict x, const WT *restrict w, T *restrict y, int64_t D,        \
                            float eps) {                                                                \
    float ss = 0.f;                                                                                     \
    _Pragma("omp simd reduction(+:ss)")                                                                 \
    for (int64_t d = 0; d < D; d++) { const float a = IN(x[d]); ss += a * a; }                          \
    const float r = 1.0f / sqrtf(ss / (float)D + eps);                                                  \
    _Pragma("omp simd")                                                                                 \
    for (int64_t d = 0; d < D; d++) y[d] = OUT(WIN(w[d]) * NORMED(IN(x[d]) * r));                       \
    return y;                                                                                           \
}
HEAD_NORM(head_norm_f32, float, f32_in, f32_out, AS_IS, float, f32_in)
HEAD_NORM(head_norm_bf16, uint16_t, bf16_in, bf16_out, ROUNDED_BF16, uint16_t, bf16_in)
HEAD_NORM(head_norm_scale32_bf16, uint16_t, bf16_in, bf16_out, AS_IS, uint16_t, bf16_in)
/* Gemma's bf16 norm: its weights fp32 (1 + w), the product in fp32, rounded once. */
HEAD_NORM(head_norm_w32_bf16, uint16_t, bf16_in, bf16_out, AS_IS, float, f32_in)

/* -- one layer's attention block after the q/k/v projection, fused ----------------------------------

   qkv (M, (H + 2 Hkv) D) in the model dtype T (fp32 or bf16; the cache has the same dtype), token t of
   the sequence in table row row[t] at position pos[t]: RoPE on the first R dims of its q and k heads (cos/sin
   rows of the backend's table cs (>= W bs, 2, R), sin's first half negated: x cos + rot(x) sin, rot swapping
   the halves of those R; dims R..D-1 pass as they are: Phi-4-mini's partial rotary, R = D elsewhere), its
   k and v written into the cache, then its q attends to positions [0, pos[t]] of its
   sequence (the last `window` of them where window > 0); out (M, H D) in T. A decode token is one per row; a prefill piece is consecutive tokens of
   one row in increasing positions, each attending causally to those before it (written by then). As
   torch, the rotated q/k are rounded to T before use; bf16 is rounded to nearest even. Rows, positions
   and blocks are all checked before anything is written. scratch >= G W bs + 2 G D floats. qkn: Qwen3's
   q and k norm weights (H + Hkv, D) in T, or NULL: then each head's q and k go through HEAD_NORM before
   RoPE. Returns 0, -1 (D > 256 or odd, or R odd or past D) or check_tokens' code. */
#define FUSED(NAME, T, IN, OUT, ATTEND, NORM, QT)                                                       \
int NAME(const T *restrict qkv, const T *restrict cs, const int32_t *restrict tbl,                      \
         const int64_t *restrict row, const int64_t *restrict pos, T *restrict k, T *restrict v,         \
         T *restrict out, int64_t M, int64_t rows, int64_t W, int64_t Hkv, int64_t G, int64_t D,         \
         int64_t bs, int64_t nblocks, float scale, float *restrict scratch, const QT *restrict qkn,      \
         float eps, int64_t R, int64_t window, float cap) {                                              \
    if (D > 256 || D % 2 || R % 2 || R > D || R < 2) return -1;                                          \
    const int rc = check_tokens(row, 0, pos, M, tbl, rows, W, bs, nblocks);                              \
    if (rc) return rc;                                                                                   \
    const int64_t H = Hkv * G, Wq = (H + 2 * Hkv) * D, half = R / 2, J = M * Hkv, bstride = Hkv * bs * D; \
    float *qf = scratch + G * W * bs, *of = qf + G * D;                                                  \
    T kn[256], qn[256]; /* a head's normalized k and q, where qkn is given */                            \
    for (int64_t j = 0; j < PF_AHEAD && j < J; j++) PREFETCH(T, tbl + row[j / Hkv] * W, j % Hkv, pos[j / Hkv]); \
    for (int64_t j = 0; j < J; j++) {                                                                    \
        const int64_t t = j / Hkv, h = j % Hkv, p = pos[t];                                              \
        const int32_t *tb = tbl + row[t] * W;                                                            \
        if (j + PF_AHEAD < J) {                                                                          \
            const int64_t a = j + PF_AHEAD;                                                              \
            PREFETCH(T, tbl + row[a / Hkv] * W, a % Hkv, pos[a / Hkv]);                                  \
        }                                                                                                \
        const T *src = qkv + t * Wq, *c = cs + p * 2 * R, *sn = c + R;                                   \
        const int64_t at = ((int64_t)tb[p / bs] * Hkv + h) * bs * D + (p % bs) * D;                      \
        T *kw = k + at, *vw = v + at;                                                                    \
        const T *ks = src + (H + h) * D, *vs = src + (H + Hkv + h) * D;                                  \
        if (qkn) ks = NORM(ks, qkn + (H + h) * D, kn, D, eps);                                           \
        /* RoPE as two loops over the halves (d + half and d - half: no select, so they vectorize) */ \
        _Pragma("omp simd")                                                                              \
        for (int64_t d = 0; d < half; d++) {                                                             \
            kw[d] = OUT(IN(ks[d]) * IN(c[d]) + IN(ks[d + half]) * IN(sn[d]));                            \
            kw[d + half] = OUT(IN(ks[d + half]) * IN(c[d + half]) + IN(ks[d]) * IN(sn[d + half]));       \
        }                                                                                                \
        memcpy(kw + R, ks + R, (D - R) * sizeof(T)); /* the dims RoPE leaves */                          \
        memcpy(vw, vs, D * sizeof(T));                                                                   \
        for (int64_t g = 0; g < G; g++) {                                                                \
            const T *qs = src + (h * G + g) * D;                                                         \
            if (qkn) qs = NORM(qs, qkn + (h * G + g) * D, qn, D, eps);                                   \
            float *qg = qf + g * D;                                                                      \
            _Pragma("omp simd")                                                                          \
            for (int64_t d = 0; d < half; d++) {                                                         \
                qg[d] = IN(OUT(IN(qs[d]) * IN(c[d]) + IN(qs[d + half]) * IN(sn[d])));                    \
                qg[d + half] = IN(OUT(IN(qs[d + half]) * IN(c[d + half]) + IN(qs[d]) * IN(sn[d + half]))); \
            }                                                                                            \
            for (int64_t d = R; d < D; d++) qg[d] = IN(qs[d]);                                           \
        }                                                                                                \
        const int64_t lo = WINDOW_START(p, window), bk = lo / bs;                                        \
        ATTEND(qf, k + h * bs * D, v + h * bs * D, tb + bk, bs, bstride, p + 1 - bk * bs, lo - bk * bs, G, D, \
               scale, cap, scratch, of);                                                                 \
        T *o = out + t * H * D + h * G * D;                                                              \
        for (int64_t i = 0; i < G * D; i++) o[i] = OUT(of[i]);                                           \
    }                                                                                                    \
    return 0;                                                                                            \
}

FUSED(decode_layer_f32, float, f32_in, f32_out, attend_f32, head_norm_f32, float)
FUSED(decode_layer_bf16, uint16_t, bf16_in, bf16_out, attend_bf16, head_norm_bf16, uint16_t)
/* Gemma 3's bf16 layer: its q/k norm weights fp32 (1 + w), each head scaled in fp32, rounded once. */
FUSED(decode_layer_w32_bf16, uint16_t, bf16_in, bf16_out, attend_bf16, head_norm_w32_bf16, float)

/* -- the elementwise ops between the GEMMs ---------------------------------------------------------- */

/* RMSNorm of each row of x (M, N) as the model's: y = w * round(x / sqrt(mean(x^2) + eps)), the mean
   in fp32, both products rounded to T (HEAD_NORM over a row). */
#define RMS(NAME, T, NORM, WT)                                                                          \
void NAME(const T *restrict x, const WT *restrict w, T *restrict y, int64_t M, int64_t N, float eps) {  \
    for (int64_t m = 0; m < M; m++) NORM(x + m * N, w, y + m * N, N, eps);                              \
}
RMS(rms_f32, float, head_norm_f32, float)
RMS(rms_bf16, uint16_t, head_norm_bf16, uint16_t)

/* OLMo2's RMSNorm of each row in bf16: scaled in fp32, rounded once (in fp32 it is rms_f32). */
RMS(rms_scale32_bf16, uint16_t, head_norm_scale32_bf16, uint16_t)

/* Gemma's RMSNorm of each row in bf16: scaled in fp32 by fp32 weights (its 1 + w), rounded once. */
RMS(rms_w32_bf16, uint16_t, head_norm_w32_bf16, float)

/* out (M, I) = act(gu[:, :I]) * gu[:, I:], gu (M, 2 I), act(g) = g / (1 + e^-Z(g)): SiLU (Z(g) = g), and
   Gemma's GELU with the tanh approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), which is
   g / (1 + e^-2y) for y that tanh's argument. In fp32, the product rounded to T. e^x by exp_poly (which
   clamps: a huge |g| gives g or 0, as the exact functions). */
#define SILU_Z(a) (a)
#define GELU_Z(a) (1.5957691216057308f * (a) + 0.0713548162726f * (a) * (a) * (a)) /* 2 sqrt(2/pi) (a + 0.044715 a^3) */
#define GLU_MUL(NAME, T, IN, OUT, Z)                                                                    \
void NAME(const T *restrict gu, T *restrict out, int64_t M, int64_t I) {                                \
    for (int64_t m = 0; m < M; m++) {                                                                   \
        const T *g = gu + m * 2 * I, *u = g + I;                                                        \
        T *o = out + m * I;                                                                             \
        _Pragma("omp simd")                                                                             \
        for (int64_t i = 0; i < I; i++) {                                                               \
            const float a = IN(g[i]);                                                                   \
            o[i] = OUT(a / (1.0f + exp_poly(-Z(a))) * IN(u[i]));                                        \
        }                                                                                               \
    }                                                                                                   \
}
GLU_MUL(silu_mul_f32, float, f32_in, f32_out, SILU_Z)
GLU_MUL(silu_mul_bf16, uint16_t, bf16_in, bf16_out, SILU_Z)
GLU_MUL(gelu_mul_f32, float, f32_in, f32_out, GELU_Z)
GLU_MUL(gelu_mul_bf16, uint16_t, bf16_in, bf16_out, GELU_Z)

/* -- LoRA: the low-rank terms of rows of several adapters (tailrace/engine/adapters.py) -------------- */

/* For each row m of x (M, K) whose adapter slot s = slot[m] is >= 0: u = A[s] x[m] (A: (S, R, K)), then
   for each segment g (a target projection: columns [cols[g], cols[g+1]) of y, ranks [rk[g], rk[g+1]) of
   u) y[m, c] += sum_r u[r] Bt[s, r, c] (Bt: (S, R, N), B transposed so the sums over columns vectorize,
   the adapter's scale folded in); y (M, N) in place. Rows with slot < 0 are left as they are. fp32
   arithmetic, y rounded once to T.
   The rows of one slot go through in blocks of LORA_ROWS, so each row of A and Bt is read once per block
   rather than once per row (per row, an adapter's weights are as many bytes as its terms' multiplies).
   Each row's sums run in the same order whatever block it is in: its result does not depend on the
   other rows (a batch of mixed adapters equals each adapter's rows alone).
   work: LORA_ROWS (R + N) floats + M int64. Returns -5 for a slot >= S. */
#define LORA_ROWS 8
#define LORA_COLS 16  /* columns per register block of the B^T sums (a segment's other columns: one by one) */
#define LORA(NAME, T, IN, OUT)                                                                          \
int NAME(const T *restrict x, const T *restrict A, const T *restrict Bt, const int32_t *restrict slot,   \
         T *restrict y, int64_t M, int64_t K, int64_t N, int64_t R, int64_t S, int64_t nseg,            \
         const int64_t *restrict cols, const int64_t *restrict rk, float *restrict work) {               \
    float *restrict u = work;                                                                           \
    int64_t *restrict rows = (int64_t *)(work + LORA_ROWS * (R + N));                                   \
    for (int64_t m = 0; m < M; m++) if (slot[m] >= S) return -5;                                        \
    for (int64_t s = 0; s < S; s++) {                                                                   \
        int64_t n = 0;                                                                                  \
        for (int64_t m = 0; m < M; m++) if (slot[m] == s) rows[n++] = m;                                \
        const T *As = A + s * R * K, *Bs = Bt + s * R * N;                                              \
        for (int64_t j0 = 0; j0 < n; j0 += LORA_ROWS) {                                                 \
            const int64_t nb = n - j0 < LORA_ROWS ? n - j0 : LORA_ROWS;                                 \
            for (int64_t j = 0; j < nb; j++) {  /* u = A x, four ranks per pass over x */               \
                const T *xm = x + rows[j0 + j] * K;                                                     \
                int64_t r = 0;                                                                          \
                for (; r + 4 <= R; r += 4) {                                                            \
                    const T *a0 = As + r * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;                 \
                    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;                                       \
                    _Pragma("omp simd reduction(+:d0,d1,d2,d3)")                                        \
                    for (int64_t k = 0; k < K; k++) {                                                   \
                        const float xk = IN(xm[k]);                                                     \
                        d0 += IN(a0[k]) * xk; d1 += IN(a1[k]) * xk;                                     \
                        d2 += IN(a2[k]) * xk; d3 += IN(a3[k]) * xk;                                     \
                    }                                                                                   \
                    float *uj = u + j * R + r;                                                          \
                    uj[0] = d0; uj[1] = d1; uj[2] = d2; uj[3] = d3;                                     \
                }                                                                                       \
                for (; r < R; r++) {                                                                    \
                    const T *a = As + r * K;                                                            \
                    float d = 0.f;                                                                      \
                    _Pragma("omp simd reduction(+:d)")                                                  \
                    for (int64_t k = 0; k < K; k++) d += IN(a[k]) * IN(xm[k]);                          \
                    u[j * R + r] = d;                                                                   \
                }                                                                                       \
            }                                                                                           \
            for (int64_t g = 0; g < nseg; g++) {  /* y += u B^T, LORA_COLS columns in registers */      \
                const int64_t c0 = cols[g], c1 = cols[g + 1], r0 = rk[g], r1 = rk[g + 1];               \
                if (r1 == r0) continue;                                                                 \
                for (int64_t j = 0; j < nb; j++) {                                                      \
                    T *ym = y + rows[j0 + j] * N;                                                       \
                    const float *uj = u + j * R;                                                        \
                    int64_t c = c0;                                                                     \
                    for (; c + LORA_COLS <= c1; c += LORA_COLS) {                                       \
                        float t[LORA_COLS] = {0.f};                                                     \
                        for (int64_t r = r0; r < r1; r++) {                                             \
                            const float ur = uj[r];                                                     \
                            const T *b = Bs + r * N + c;                                                \
                            _Pragma("omp simd")                                                         \
                            for (int q = 0; q < LORA_COLS; q++) t[q] += IN(b[q]) * ur;                  \
                        }                                                                               \
                        _Pragma("omp simd")                                                             \
                        for (int q = 0; q < LORA_COLS; q++) ym[c + q] = OUT(IN(ym[c + q]) + t[q]);      \
                    }                                                                                   \
                    for (; c < c1; c++) {                                                               \
                        float t = 0.f;                                                                  \
                        for (int64_t r = r0; r < r1; r++) t += IN(Bs[r * N + c]) * uj[r];               \
                        ym[c] = OUT(IN(ym[c]) + t);                                                     \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    return 0;                                                                                           \
}
LORA(lora_f32, float, f32_in, f32_out)
LORA(lora_bf16, uint16_t, bf16_in, bf16_out)

/* -- sampling (see tailrace/engine/sampler.py, whose hash this is) --------------------------------- */

/* ln x for a normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s), s = (m-1)/(m+1),
   |s| <= 0.172, odd series to s^9: relative error ~1e-7; inlines into vectorized loops. */
static inline float log_poly(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    int32_t e = (int32_t)((u >> 23) & 0xff) - 127;
    u = (u & 0x007fffffu) | 0x3f800000u;  /* m in [1, 2) */
    float m; memcpy(&m, &u, 4);
    if (m > 1.41421356f) { m *= 0.5f; e += 1; }
    const float s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
    const float p = s * (2.0f + s2 * (2.0f / 3 + s2 * (2.0f / 5 + s2 * (2.0f / 7 + s2 * (2.0f / 9)))));
    return (float)e * 0.693147180559945f + p;
}

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    x ^= x >> 15;
    return x;
}

/* Standard Gumbel noise of vocab entry v for a row whose hash base is `row`: u from 23 bits of
   mix32(row + salt[v]), (bits + 0.5) / 2^23, exact in fp32 and strictly inside (0, 1), g = -ln(-ln u),
   so g lies in [-2.81, 16.64] (24 bits would round the top value's u to 1 and give that entry g = +inf
   in torch, 88 here: a token drawn whatever the logits, in ~V / 2^24 of all draws). */
static inline float gumbel_one(uint32_t row, int64_t salt) {
    const uint32_t bits = mix32(row + (uint32_t)salt) >> 9;
    const float u = ((float)bits + 0.5f) * (1.0f / 8388608.0f);
    return -log_poly(-log_poly(u));
}

static inline uint32_t row_base(int64_t key, int64_t index) {
    return (uint32_t)((uint64_t)key + (uint64_t)index * 0x2545F491u);
}

/* out (B, V) fp32: the noise of row b (key[b * ks], index[b * is]) for every vocab id. */
void gumbel_f32(const int64_t *restrict key, int64_t ks, const int64_t *restrict index, int64_t is,
                const int64_t *restrict salt, float *restrict out, int64_t B, int64_t V) {
    for (int64_t b = 0; b < B; b++) {
        const uint32_t row = row_base(key[b * ks], index[b * is]);
        float *o = out + b * V;
#pragma omp simd
        for (int64_t v = 0; v < V; v++) o[v] = gumbel_one(row, salt[v]);
    }
}

/* z[v] = IN(l[v]) * it for v < n; returns the largest z that is not NaN (-inf when none is) and sets
   *at to the first v holding it (0 when none does): `if (z[v] > top) top = z[v], at = v` from
   top = -inf, exactly. */
#define SCALE_MAX(NAME, T, IN, LD)                                                                      \
static float NAME(const T *restrict l, float it, float *restrict z, int64_t n, int64_t *restrict at) {  \
    float m = -INFINITY;                                                                                \
    int64_t v = 0, best = 0;                                                                            \
    SCALE_MAX_AVX512(LD)                                                                                \
    for (; v < n; v++) {                                                                                \
        z[v] = IN(l[v]) * it;                                                                           \
        if (z[v] > m) { m = z[v]; best = v; }                                                           \
    }                                                                                                   \
    *at = best;                                                                                         \
    return m;                                                                                           \
}
#if defined(__AVX512F__)
/* The first maximum of a row, 16 lanes at a time: each lane keeps its first maximum (strictly greater
   replaces, NaN never does); the maximum is the lanes' largest and its first index the smallest among
   the lanes holding it. */
typedef struct { __m512 top; __m512i at, idx; } FirstMax;
static inline FirstMax first_max_start(void) {
    const FirstMax f = {_mm512_set1_ps(-INFINITY), _mm512_setzero_si512(),
                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)};
    return f;
}
static inline void first_max_add(FirstMax *f, __m512 x) {  /* the next 16 entries */
    const __mmask16 gt = _mm512_cmp_ps_mask(x, f->top, _CMP_GT_OQ);
    f->top = _mm512_mask_mov_ps(f->top, gt, x);
    f->at = _mm512_mask_mov_epi32(f->at, gt, f->idx);
    f->idx = _mm512_add_epi32(f->idx, _mm512_set1_epi32(16));
}
static inline float first_max_end(const FirstMax *f, int64_t *at) {  /* *at unchanged when all -inf */
    const float m = _mm512_reduce_max_ps(f->top);
    if (m > -INFINITY)
        *at = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(f->top, _mm512_set1_ps(m), _CMP_EQ_OQ), f->at);
    return m;
}
#define SCALE_MAX_AVX512(LD)                                                                            \
    if (n < ((int64_t)1 << 31)) {                                                                       \
        const __m512 vi = _mm512_set1_ps(it);                                                           \
        FirstMax f = first_max_start();                                                                 \
        for (; v + 16 <= n; v += 16) {                                                                  \
            const __m512 x = _mm512_mul_ps(LD(l + v), vi);                                              \
            _mm512_storeu_ps(z + v, x);                                                                 \
            first_max_add(&f, x);                                                                       \
        }                                                                                               \
        m = first_max_end(&f, &best);                                                                   \
    }
SCALE_MAX(scale_max_f32, float, f32_in, ld_f32)
SCALE_MAX(scale_max_bf16, uint16_t, bf16_in, ld_bf16)
#else
#define SCALE_MAX_AVX512(LD)
SCALE_MAX(scale_max_f32, float, f32_in, _)
SCALE_MAX(scale_max_bf16, uint16_t, bf16_in, _)
#endif

/* The first v < n with y[v] the largest y that is not NaN; 0 when every y is -inf or NaN (the scalar
   loop `if (y[v] > top) best = v` from top = -inf, whose result this is exactly). */
static int64_t first_argmax(const float *restrict y, int64_t n) {
    int64_t v = 0, best = 0;
    float top = -INFINITY;
#if defined(__AVX512F__)
    if (n < ((int64_t)1 << 31)) {
        FirstMax f = first_max_start();
        for (; v + 16 <= n; v += 16) first_max_add(&f, _mm512_loadu_ps(y + v));
        top = first_max_end(&f, &best);
    }
#endif
    for (; v < n; v++)
        if (y[v] > top) { top = y[v]; best = v; }
    return best;
}

/* An upper bound of the noise of every bit pattern in each of 4096 buckets (bits >> 11): g is increasing
   in the bits, so a bucket's largest pattern bounds the rest; the margin covers the polynomial logs'
   error (the exact bound of each pattern is tested over all 2^23). Built on first use (every thread
   writes the same values). */
#define BUCKET_SHIFT 11
#define BUCKETS (1 << (23 - BUCKET_SHIFT))
static float gumbel_bucket_max[BUCKETS];
static volatile int gumbel_buckets_ready;
static const float *gumbel_buckets(void) {
    if (!gumbel_buckets_ready) {
        for (int i = 0; i < BUCKETS; i++) {
            const uint32_t bits = ((uint32_t)i << BUCKET_SHIFT) | ((1u << BUCKET_SHIFT) - 1u);
            const float u = ((float)bits + 0.5f) * (1.0f / 8388608.0f);
            const float g = -log_poly(-log_poly(u));
            gumbel_bucket_max[i] = g + 1e-3f;
        }
        gumbel_buckets_ready = 1;
    }
    return gumbel_bucket_max;
}

/* The noise of each 23-bit pattern bits[i] (as gumbel_one draws it) and its bucket's bound (tests). */
void gumbel_of_bits(const uint32_t *restrict bits, int64_t n, float *restrict g, float *restrict bound) {
    const float *gb = gumbel_buckets();
    for (int64_t i = 0; i < n; i++) {
        const float u = ((float)bits[i] + 0.5f) * (1.0f / 8388608.0f);
        g[i] = -log_poly(-log_poly(u));
        bound[i] = gb[bits[i] >> BUCKET_SHIFT];
    }
}

/* Whether any of the c (<= 16) entries from v could reach `floor`: z[v] + sc * (its bucket's bound) >=
   floor. The bits cost a hash, the bound a table read: no logarithm. */
static inline int chunk_live(const float *restrict z, float sc, uint32_t row, const int64_t *restrict salt,
                             int64_t v, int64_t c, float floor, const float *restrict gb) {
#if defined(__AVX512F__)
    if (c == 16) {
        const __m256i s0 = _mm512_cvtepi64_epi32(_mm512_loadu_si512(salt + v));
        const __m256i s1 = _mm512_cvtepi64_epi32(_mm512_loadu_si512(salt + v + 8));
        __m512i x = _mm512_add_epi32(_mm512_inserti64x4(_mm512_castsi256_si512(s0), s1, 1), _mm512_set1_epi32((int)row));
        x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
        x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x21F0AAAD));
        x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
        x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x735A2D97));
        x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
        const __m512 bound = _mm512_i32gather_ps(_mm512_srli_epi32(x, 9 + BUCKET_SHIFT), gb, 4);
        const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(sc), bound, _mm512_loadu_ps(z + v));
        return _mm512_cmp_ps_mask(t, _mm512_set1_ps(floor), _CMP_GE_OQ) != 0;
    }
#endif
    for (int64_t i = 0; i < c; i++)
        if (z[v + i] + sc * gb[(mix32(row + (uint32_t)salt[v + i]) >> 9) >> BUCKET_SHIFT] >= floor) return 1;
    return 0;
}

/* The first argmax over v of z[v] + sc * gumbel(v), given a, the first argmax of z (sc > 0). The
   winner's value is at least floor = the best value so far (from a's own): a 16-entry chunk whose
   entries all stay below it even with their bucket's bound (chunk_live) cannot hold the winner, and its
   noise is never computed (most of a vocabulary: few entries have a noise large enough to bridge their
   gap to the top). The others are compared in order, strictly greater replacing, so the token is exactly
   that of adding the noise everywhere. A negative sc (not used by the engine) computes every entry;
   below SKIP_MIN_VOCAB entries (w: V floats of scratch) the noise of every entry is computed in one
   pass, cheaper than sixteen at a time there. */
#define SKIP_MIN_VOCAB 2048
static int64_t noisy_argmax(const float *restrict z, float sc, uint32_t row, const int64_t *restrict salt,
                            int64_t V, int64_t a, float *restrict w) {
    if (V < SKIP_MIN_VOCAB || !(sc > 0.0f)) {  /* the noise of all of it in one vectorized pass */
#pragma omp simd
        for (int64_t v = 0; v < V; v++) w[v] = z[v] + sc * gumbel_one(row, salt[v]);
        return first_argmax(w, V);
    }
    const float *gb = gumbel_buckets();
    const float at_a = z[a] + sc * gumbel_one(row, salt[a]);
    float top = -INFINITY, y[16];
    int64_t best = 0;
    for (int64_t v = 0; v < V; v += 16) {
        const int64_t c = V - v < 16 ? V - v : 16;  /* the last chunk may be short */
        if (!chunk_live(z, sc, row, salt, v, c, top > at_a ? top : at_a, gb)) continue;
        float cm = -INFINITY;
#pragma omp simd reduction(max:cm)
        for (int64_t i = 0; i < c; i++) {
            y[i] = z[v + i] + sc * gumbel_one(row, salt[v + i]);
            cm = y[i] > cm ? y[i] : cm;
        }
        if (!(cm > top)) continue;  /* the chunk's best does not beat the best so far (NaN never does) */
        for (int64_t i = 0; i < c; i++)
            if (y[i] > top) { top = y[i]; best = v + i; }
    }
    return best;
}

/* One draw per row of logits (B, V) in T (fp32 or bf16): z = logits * inv_temp (fp32), token = the first
   argmax of z + noise_scale * gumbel (noise_scale 0: greedy), logprob = z[token] - logsumexp(z). Per-row
   operands are strided columns (the engine's row-state tensors). As torch's path it adds the noise to z,
   not to log_softmax(z), so both draw the same token bit for bit given the same noise. Three passes over
   a row: scale (and its max), the noisy argmax over the chunks that can win, the sum of exponentials. */
#define SAMPLE(NAME, T, SCALE_MAX_T)                                                                    \
void NAME(const T *restrict logits, const float *restrict inv_temp, int64_t ts,                         \
          const float *restrict noise_scale, int64_t ns, const int64_t *restrict key, int64_t ks,        \
          const int64_t *restrict index, int64_t is, const int64_t *restrict salt, int64_t B, int64_t V, \
          float *restrict z /* 2 V scratch */, int64_t *restrict tokens, float *restrict logprobs) {     \
    for (int64_t b = 0; b < B; b++) {                                                                   \
        const float it = inv_temp[b * ts], sc = noise_scale[b * ns];                                    \
        const uint32_t row = row_base(key[b * ks], index[b * is]);                                      \
        int64_t a;                                                                                      \
        const float m = SCALE_MAX_T(logits + b * V, it, z, V, &a);                                      \
        const int64_t best = sc != 0.0f ? noisy_argmax(z, sc, row, salt, V, a, z + V) : a;             \
        float sum = 0.f;                                                                                \
        _Pragma("omp simd reduction(+:sum)")                                                            \
        for (int64_t v = 0; v < V; v++) sum += exp_poly(z[v] - m);                                      \
        tokens[b] = best;                                                                               \
        logprobs[b] = z[best] - (m + logf(sum));                                                        \
    }                                                                                                   \
}
SAMPLE(sample_f32, float, scale_max_f32)
SAMPLE(sample_bf16, uint16_t, scale_max_bf16)
