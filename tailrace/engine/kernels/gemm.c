/* The engine step's GEMMs, y = x W^T (+ b) (+ r), single-threaded: bf16 on AVX-512 BF16 (vdpbf16ps),
   fp32 on AVX-512 (vfmadd231ps).

   Why: at decode sizes (a few to a few hundred rows) every layer's weights stream from DRAM once per
   step, and oneDNN's brgemm (what torch's packed linears run) leaves that stream to the hardware
   prefetcher: measured on a Zen 4 core, its bf16 GEMMs over weights not in cache ran at 55-85% of
   their speed on cache-hot weights. Here W is packed in panels of 48 columns, k in pairs
   ([N/48][K/2][48][2], the operand layout of vdpbf16ps), a panel is read once from memory for all rows
   of x while the next panel is prefetched into L2, and an 8 x 48 block of y stays in 24 registers
   across the whole k loop. Each output is the fp32 dot product of its row and column (pairs of
   products accumulated by vdpbf16ps), plus b and r in fp32, rounded to bf16 once (nearest even).
   fp32 is the same blocking with k one at a time ([N/48][K][48]). Figures: bench/README.md. */
#include <stdint.h>
#include <string.h>

#define NR 48 /* columns per panel: three 16-lane vectors */
#define MR 8  /* rows per register block */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_F32 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define HAVE_BF16 1

/* Row i of the block: its accumulators (+ b, + r) rounded to bf16 and stored, ncols <= 48 of them. */
static inline void store_row(uint16_t *restrict y, const uint16_t *restrict r, const float *restrict b,
                             const __m512 *acc, int64_t ncols) {
    for (int j = 0; j < 3; j++) {
        const int64_t c = ncols - 16 * j;
        if (c <= 0) break;
        const __mmask16 m = c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << c) - 1u);
        __m512 v = acc[j];
        if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + 16 * j));
        if (r) {
            const __m256i rb = _mm256_maskz_loadu_epi16(m, r + 16 * j);
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rb), 16)));
        }
        _mm256_mask_storeu_epi16(y + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* ROWS (1-8) rows of x against one panel; pf, when set, is the next panel, prefetched into L2 (three
   cache lines per k pair: the whole panel over the k loop). */
#define BLOCK(ROWS)                                                                                   \
    static inline __attribute__((always_inline)) void block##ROWS(                                    \
        const uint16_t *restrict x, int64_t K, const uint16_t *restrict panel,                        \
        const uint16_t *restrict pf, uint16_t *restrict y, const uint16_t *restrict r,                \
        const float *restrict b, int64_t ld, int64_t ncols) {                                         \
        __m512 acc[ROWS][3];                                                                          \
        for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();       \
        const int64_t kp = K / 2;                                                                     \
        for (int64_t k = 0; k < kp; k++) {                                                            \
            const uint16_t *wk = panel + k * (NR * 2);                                                \
            if (pf) {                                                                                 \
                const char *p = (const char *)(pf + k * (NR * 2));                                    \
                _mm_prefetch(p, _MM_HINT_T1);                                                         \
                _mm_prefetch(p + 64, _MM_HINT_T1);                                                    \
                _mm_prefetch(p + 128, _MM_HINT_T1);                                                   \
            }                                                                                         \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);                                     \
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);                                \
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);                                \
            for (int i = 0; i < ROWS; i++) {                                                          \
                int32_t pair;                                                                         \
                memcpy(&pair, x + i * K + 2 * k, 4);                                                  \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                \
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);                                      \
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);                                      \
                acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);                                      \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < ROWS; i++)                                                                \
            store_row(y + i * ld, r ? r + i * ld : 0, b, acc[i], ncols);                              \
    }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8)

typedef void (*block_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *,
                         const uint16_t *, const float *, int64_t, int64_t);
static const block_fn BLOCKS[MR + 1] = {0, block1, block2, block3, block4, block5, block6, block7, block8};

/* y (M, N) = x (M, K) W^T (+ b (N,) fp32) (+ r (M, N)); x, r, y bf16 contiguous, K even, W packed by
   the caller (see the file's comment; columns past N zero). b, r may be NULL. */
void gemm_bf16(const uint16_t *restrict x, int64_t M, int64_t K, const uint16_t *restrict packed, int64_t N,
               const float *restrict b, const uint16_t *restrict r, uint16_t *restrict y) {
    const int64_t panels = (N + NR - 1) / NR, size = K / 2 * NR * 2;
    for (int64_t p = 0; p < panels; p++) {
        const uint16_t *panel = packed + p * size;
        const uint16_t *next = p + 1 < panels ? panel + size : 0;
        const int64_t c0 = p * NR, ncols = N - c0 < NR ? N - c0 : NR;
        for (int64_t m = 0; m < M; m += MR) {
            const int64_t rows = M - m < MR ? M - m : MR;
            BLOCKS[rows](x + m * K, K, panel, m == 0 ? next : 0, y + m * N + c0, r ? r + m * N + c0 : 0,
                         b ? b + c0 : 0, N, ncols);
        }
    }
}

/* int8 weights, bf16 activations (a quantized drafter's GEMM): W as int8 in the bf16 layout
   ([N/48][K/2][48][2]) with one fp32 scale per column; each k pair's 96 weights are widened to bf16 in
   registers (exact: |q| <= 127) and the column's scale applied once to its sum. Half the bytes of bf16
   weights, which is the whole cost of a decode step's GEMM at a few rows. */
static inline __m512bh widen_i8(const int8_t *p) {  /* 32 int8 -> 32 bf16, in memory order */
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#define BLOCK_I8(ROWS)                                                                                \
    static inline __attribute__((always_inline)) void block_i8_##ROWS(                                \
        const uint16_t *restrict x, int64_t K, const int8_t *restrict panel, const int8_t *restrict pf, \
        uint16_t *restrict y, const uint16_t *restrict r, const float *restrict b,                    \
        const float *restrict sc, int64_t ld, int64_t ncols) {                                        \
        __m512 acc[ROWS][3];                                                                          \
        for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();       \
        const int64_t kp = K / 2;                                                                     \
        for (int64_t k = 0; k < kp; k++) {                                                            \
            const int8_t *wk = panel + k * (NR * 2);                                                  \
            if (pf) {                                                                                 \
                const char *p = (const char *)(pf + k * (NR * 2));                                    \
                _mm_prefetch(p, _MM_HINT_T1);                                                         \
                _mm_prefetch(p + 64, _MM_HINT_T1);                                                    \
            }                                                                                         \
            const __m512bh w0 = widen_i8(wk), w1 = widen_i8(wk + 32), w2 = widen_i8(wk + 64);         \
            for (int i = 0; i < ROWS; i++) {                                                          \
                int32_t pair;                                                                         \
                memcpy(&pair, x + i * K + 2 * k, 4);                                                  \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                \
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);                                      \
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);                                      \
                acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);                                      \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < ROWS; i++) {                                                              \
            __m512 a[3];                                                                              \
            for (int j = 0; j < 3; j++) {                                                             \
                const int64_t c = ncols - 16 * j;                                                     \
                const __mmask16 m = c >= 16 ? (__mmask16)0xffff : c > 0 ? (__mmask16)((1u << c) - 1u) : 0; \
                a[j] = _mm512_mul_ps(acc[i][j], _mm512_maskz_loadu_ps(m, sc + 16 * j));               \
            }                                                                                         \
            store_row(y + i * ld, r ? r + i * ld : 0, b, a, ncols);                                   \
        }                                                                                             \
    }
BLOCK_I8(1) BLOCK_I8(2) BLOCK_I8(3) BLOCK_I8(4) BLOCK_I8(5) BLOCK_I8(6) BLOCK_I8(7) BLOCK_I8(8)

typedef void (*block_i8_fn)(const uint16_t *, int64_t, const int8_t *, const int8_t *, uint16_t *,
                            const uint16_t *, const float *, const float *, int64_t, int64_t);
static const block_i8_fn BLOCKS_I8[MR + 1] = {0, block_i8_1, block_i8_2, block_i8_3, block_i8_4,
                                              block_i8_5, block_i8_6, block_i8_7, block_i8_8};

/* y (M, N) = x (M, K) (W diag(scale))^T (+ b) (+ r), W int8 packed as bf16's layout; bf16 x, r, y. */
void gemm_i8(const uint16_t *restrict x, int64_t M, int64_t K, const int8_t *restrict packed,
             const float *restrict scale, int64_t N, const float *restrict b, const uint16_t *restrict r,
             uint16_t *restrict y) {
    const int64_t panels = (N + NR - 1) / NR, size = K / 2 * NR * 2;
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *panel = packed + p * size;
        const int8_t *next = p + 1 < panels ? panel + size : 0;
        const int64_t c0 = p * NR, ncols = N - c0 < NR ? N - c0 : NR;
        for (int64_t m = 0; m < M; m += MR) {
            const int64_t rows = M - m < MR ? M - m : MR;
            BLOCKS_I8[rows](x + m * K, K, panel, m == 0 ? next : 0, y + m * N + c0, r ? r + m * N + c0 : 0,
                            b ? b + c0 : 0, scale + c0, N, ncols);
        }
    }
}
#endif /* __AVX512BF16__ */

/* fp32: y (M, N) = x (M, K) W^T (+ b) (+ r), W packed as [N/48][K][48] (k single, columns past N zero);
   the same blocking, one k at a time (vfmadd231ps on a broadcast of x). */
static inline void store_row_f32(float *restrict y, const float *restrict r, const float *restrict b,
                                 const __m512 *acc, int64_t ncols) {
    for (int j = 0; j < 3; j++) {
        const int64_t c = ncols - 16 * j;
        if (c <= 0) break;
        const __mmask16 m = c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << c) - 1u);
        __m512 v = acc[j];
        if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + 16 * j));
        if (r) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, r + 16 * j));
        _mm512_mask_storeu_ps(y + 16 * j, m, v);
    }
}
#define BLOCK_F32(ROWS)                                                                               \
    static inline __attribute__((always_inline)) void block_f32_##ROWS(                               \
        const float *restrict x, int64_t K, const float *restrict panel, const float *restrict pf,    \
        float *restrict y, const float *restrict r, const float *restrict b, int64_t ld,             \
        int64_t ncols) {                                                                              \
        __m512 acc[ROWS][3];                                                                          \
        for (int i = 0; i < ROWS; i++) acc[i][0] = acc[i][1] = acc[i][2] = _mm512_setzero_ps();       \
        for (int64_t k = 0; k < K; k++) {                                                             \
            const float *wk = panel + k * NR;                                                         \
            if (pf) {                                                                                 \
                const char *p = (const char *)(pf + k * NR);                                          \
                _mm_prefetch(p, _MM_HINT_T1);                                                         \
                _mm_prefetch(p + 64, _MM_HINT_T1);                                                    \
                _mm_prefetch(p + 128, _MM_HINT_T1);                                                   \
            }                                                                                         \
            const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);                     \
            const __m512 w2 = _mm512_loadu_ps(wk + 32);                                               \
            for (int i = 0; i < ROWS; i++) {                                                          \
                const __m512 xb = _mm512_set1_ps(x[i * K + k]);                                       \
                acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);                                       \
                acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);                                       \
                acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);                                       \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < ROWS; i++)                                                                \
            store_row_f32(y + i * ld, r ? r + i * ld : 0, b, acc[i], ncols);                          \
    }
BLOCK_F32(1) BLOCK_F32(2) BLOCK_F32(3) BLOCK_F32(4) BLOCK_F32(5) BLOCK_F32(6) BLOCK_F32(7) BLOCK_F32(8)

typedef void (*block_f32_fn)(const float *, int64_t, const float *, const float *, float *, const float *,
                             const float *, int64_t, int64_t);
static const block_f32_fn BLOCKS_F32[MR + 1] = {0, block_f32_1, block_f32_2, block_f32_3, block_f32_4,
                                                block_f32_5, block_f32_6, block_f32_7, block_f32_8};

void gemm_f32(const float *restrict x, int64_t M, int64_t K, const float *restrict packed, int64_t N,
              const float *restrict b, const float *restrict r, float *restrict y) {
    const int64_t panels = (N + NR - 1) / NR, size = K * NR;
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = packed + p * size;
        const float *next = p + 1 < panels ? panel + size : 0;
        const int64_t c0 = p * NR, ncols = N - c0 < NR ? N - c0 : NR;
        for (int64_t m = 0; m < M; m += MR) {
            const int64_t rows = M - m < MR ? M - m : MR;
            BLOCKS_F32[rows](x + m * K, K, panel, m == 0 ? next : 0, y + m * N + c0, r ? r + m * N + c0 : 0,
                             b ? b + c0 : 0, N, ncols);
        }
    }
}
#endif

/* Which GEMMs this build has: 1 fp32, 2 bf16 (a bit each). */
int gemm_supported(void) {
    int has = 0;
#ifdef HAVE_F32
    has |= 1;
#endif
#ifdef HAVE_BF16
    has |= 2;
#endif
    return has;
}
#ifndef HAVE_BF16
void gemm_i8(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed, const float *scale, int64_t N,
             const float *b, const uint16_t *r, uint16_t *y) {
    (void)x, (void)M, (void)K, (void)packed, (void)scale, (void)N, (void)b, (void)r, (void)y;
}
void gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N, const float *b,
               const uint16_t *r, uint16_t *y) {
    (void)x, (void)M, (void)K, (void)packed, (void)N, (void)b, (void)r, (void)y;
}
#endif
#ifndef HAVE_F32
void gemm_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, const float *b,
              const float *r, float *y) {
    (void)x, (void)M, (void)K, (void)packed, (void)N, (void)b, (void)r, (void)y;
}
#endif
