/* Decode attention for tailrace's engine on CPU: one query token per sequence, read in place from the
   engine's KV cache (rows, Hkv, L, D), fp32 or bf16, each row attending to exactly its own length.

   Why a kernel: as batched GEMMs (torch.bmm) this step reads every row up to the longest row of its chunk,
   builds a mask, runs softmax as separate passes and (bf16) copies strided cache views; measured, it was
   ~45% (fp32) to ~60% (bf16) of a batch-64 decode step of the default model. Here each (row, kv head)
   reads its K and V once for all G query heads that share them, in fp32 arithmetic, with the softmax in
   between. Built by tailrace/engine/ckernel.py with the system C compiler; no torch headers. */
#include <stdint.h>
#include <string.h>
#include <math.h>

/* A cache row as fp32: bf16 widened into buf (a shift: bf16 is the top half of an fp32), fp32 as is. */
static inline const float *widen_bf16(float *restrict buf, const uint16_t *restrict x, int64_t D) {
#pragma omp simd
    for (int64_t d = 0; d < D; d++) {
        uint32_t u = (uint32_t)x[d] << 16;
        memcpy(buf + d, &u, 4);
    }
    return buf;
}


/* s[i] = exp(s[i] - m) for s[i] <= m; returns the sum. Cody-Waite reduction to |r| <= ln2/2, degree-6
   Taylor polynomial: relative error ~1e-7 (float rounding); inputs below -87 give ~1e-38 instead of 0. */
static float exp_shift_sum(float *restrict s, int64_t n, float m) {
    float sum = 0.f;
#pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < n; i++) {
        float x = s[i] - m;
        x = x < -87.0f ? -87.0f : x;
        float t = x * 1.44269504088896341f;
        float fn = (t + 12582912.0f) - 12582912.0f;
        float r = x - fn * 0.693145751953125f - fn * 1.428606765330187e-06f;
        float p = 1.0f / 720.0f;
        p = p * r + 1.0f / 120.0f;
        p = p * r + 1.0f / 24.0f;
        p = p * r + 1.0f / 6.0f;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        int32_t e = ((int32_t)fn + 127) << 23;
        float sc; memcpy(&sc, &e, 4);
        float y = p * sc;
        s[i] = y;
        sum += y;
    }
    return sum;
}

/* One (row, kv head): G query heads of D over n cached positions, written to oh (G, D); DD > 0: D known
   at compile time. fp32 cache: one head at a time (g outer), its query in registers; the G heads of a kv
   head re-read the same K/V rows from L1. s holds n scores. Measured faster than t outer for fp32. */
#define HEAD_G_OUTER(NAME, DD)                                                                       \
static void NAME(const float *restrict qh, const float *restrict kb, const float *restrict vb,        \
                 int64_t n, int64_t G, int64_t D_, float scale, float *restrict s, float *restrict oh) { \
    const int64_t D = DD ? DD : D_;                                                                  \
    for (int64_t g = 0; g < G; g++) {                                                                \
        const float *qg = qh + g * D;                                                                \
        float mx = -INFINITY;                                                                        \
        for (int64_t t = 0; t < n; t++) {                                                            \
            const float *kt = kb + t * D;                                                            \
            float acc = 0.f;                                                                         \
            _Pragma("omp simd reduction(+:acc)")                                                     \
            for (int64_t d = 0; d < D; d++) acc += qg[d] * kt[d];                                    \
            acc *= scale;                                                                            \
            s[t] = acc;                                                                              \
            mx = acc > mx ? acc : mx;                                                                \
        }                                                                                            \
        const float inv = 1.0f / exp_shift_sum(s, n, mx);                                            \
        float o[DD ? DD : 256];                                                                      \
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;                                                  \
        for (int64_t t = 0; t < n; t++) {                                                            \
            const float *vt = vb + t * D;                                                            \
            const float w = s[t];                                                                    \
            _Pragma("omp simd")                                                                      \
            for (int64_t d = 0; d < D; d++) o[d] += w * vt[d];                                       \
        }                                                                                            \
        float *og = oh + g * D;                                                                      \
        for (int64_t d = 0; d < D; d++) og[d] = o[d] * inv;                                          \
    }                                                                                                \
}

/* bf16 cache: each K and V row is widened once for all G heads (t outer); s holds G x n scores. */
#define HEAD_T_OUTER(NAME, KT, WIDEN, DD)                                                                  \
static void NAME(const float *restrict qh, const KT *restrict kb, const KT *restrict vb, int64_t n,   \
                 int64_t G, int64_t D_, float scale, float *restrict s, float *restrict oh) {        \
    const int64_t D = DD ? DD : D_;                                                                  \
    float row[DD ? DD : 256];                                                                        \
    for (int64_t t = 0; t < n; t++) {                                                                \
        const float *kt = WIDEN(row, kb + t * D, D);                                                  \
        for (int64_t g = 0; g < G; g++) {                                                            \
            const float *qg = qh + g * D;                                                            \
            float acc = 0.f;                                                                         \
            _Pragma("omp simd reduction(+:acc)")                                                     \
            for (int64_t d = 0; d < D; d++) acc += qg[d] * kt[d];                                    \
            s[g * n + t] = acc * scale;                                                              \
        }                                                                                            \
    }                                                                                                \
    for (int64_t g = 0; g < G; g++) {                                                                \
        float *sg = s + g * n, mx = -INFINITY;                                                       \
        for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;                                \
        const float inv = 1.0f / exp_shift_sum(sg, n, mx);                                           \
        for (int64_t t = 0; t < n; t++) sg[t] *= inv;                                                \
    }                                                                                                \
    for (int64_t i = 0; i < G * D; i++) oh[i] = 0.f;                                                 \
    for (int64_t t = 0; t < n; t++) {                                                                \
        const float *vt = WIDEN(row, vb + t * D, D);                                                  \
        for (int64_t g = 0; g < G; g++) {                                                            \
            const float w = s[g * n + t];                                                            \
            float *og = oh + g * D;                                                                  \
            _Pragma("omp simd")                                                                      \
            for (int64_t d = 0; d < D; d++) og[d] += w * vt[d];                                      \
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

/* q (B, Hkv, G, D) fp32; cache k, v (rows, Hkv, L, D); row b reads cache row row0 + b, positions
   [0, pos[b]]; out (B, Hkv, G, D) fp32; scratch >= G * L floats. Returns 0, -1 (D > 256), -2 (a position
   outside [0, L)). */
#define DRIVER(NAME, KT, P32, P64, P128, PANY)                                                       \
int NAME(const float *restrict q, const KT *restrict k, const KT *restrict v,                         \
         const int64_t *restrict pos, float *restrict out, int64_t B, int64_t Hkv, int64_t G,         \
         int64_t D, int64_t row0, int64_t L, float scale, float *restrict scratch) {                 \
    if (D > 256) return -1;                                                                          \
    for (int64_t b = 0; b < B; b++) {                                                                \
        const int64_t n = pos[b] + 1;                                                                \
        if (n < 1 || n > L) return -2;                                                               \
        for (int64_t h = 0; h < Hkv; h++) {                                                          \
            const KT *kb = k + ((row0 + b) * Hkv + h) * L * D;                                       \
            const KT *vb = v + ((row0 + b) * Hkv + h) * L * D;                                       \
            const float *qh = q + (b * Hkv + h) * G * D;                                             \
            float *oh = out + (b * Hkv + h) * G * D;                                                 \
            if (b + 1 < B || h + 1 < Hkv) { /* the next (row, head)'s K and V, ahead of their use */      \
                const int64_t nb = h + 1 < Hkv ? b : b + 1, nh = h + 1 < Hkv ? h + 1 : 0;             \
                const int64_t pn = pos[nb] < 0 ? 0 : pos[nb] >= L ? L - 1 : pos[nb]; /* checked later */ \
                const int64_t nn = (pn + 1) * D * (int64_t)sizeof(KT);                               \
                const char *pk = (const char *)(k + ((row0 + nb) * Hkv + nh) * L * D);               \
                const char *pv = (const char *)(v + ((row0 + nb) * Hkv + nh) * L * D);               \
                for (int64_t o = 0; o < nn; o += 64) {                                               \
                    __builtin_prefetch(pk + o, 0, 3);                                                \
                    __builtin_prefetch(pv + o, 0, 3);                                                \
                }                                                                                    \
            }                                                                                        \
            if (D == 32) P32(qh, kb, vb, n, G, D, scale, scratch, oh);                               \
            else if (D == 64) P64(qh, kb, vb, n, G, D, scale, scratch, oh);                          \
            else if (D == 128) P128(qh, kb, vb, n, G, D, scale, scratch, oh);                        \
            else PANY(qh, kb, vb, n, G, D, scale, scratch, oh);                                      \
        }                                                                                            \
    }                                                                                                \
    return 0;                                                                                        \
}
DRIVER(decode_attn_f32, float, h_f32_32, h_f32_64, h_f32_128, h_f32_any)
DRIVER(decode_attn_bf16, uint16_t, h_bf16_32, h_bf16_64, h_bf16_128, h_bf16_any)
