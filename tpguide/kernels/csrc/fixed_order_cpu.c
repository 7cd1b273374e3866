/* Fixed-order CPU kernels: every output element is one sequence of fused multiply-adds in a
 * fixed order, whatever the other rows, the columns per call, the thread count or the SIMD width.
 * See tpguide/kernels/fixed_order_cpu.py (the Python side) and docs/architecture.md §6.
 *
 * The order is written in plain C, element by element, and compiled without -ffast-math and with
 * -ffp-contract=off: fmaf() is exactly rounded, so the vector code the compiler emits for a loop over
 * independent elements gives the same bits as the scalar code for a remainder.  Nothing here relies
 * on a library's blocking.
 *
 * Linear:  out[m][n] = sum over units u (in order) of  p_u[m][n],
 *          p_u[m][n] = fma chain over k = 0 .. K_unit-1 of x[m][u*K_unit + k] * w_u[n][k]
 *          (acc = 0; acc = fmaf(x, w, acc)), and the units added as ((p_0 + p_1) + p_2) + ...
 * Weights are packed once into panels of NB columns, wp[u][panel][k][j] = w_u[panel*NB + j][k] (zero
 * past N), fp32 or bf16 (bf16 widened to fp32 exactly before the fma).
 *
 * Attention: per (token, head): s_j = fmaf chain over d of q . k_j, times scale (optionally
 * soft-capped), m = max s_j, p_j = exp_nonpositive(s_j - m), l = sum_j p_j (in j order),
 * o[d] = (fmaf chain over j of p_j v_j[d]) / l.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
/* Which intrinsics paths are compiled; -DTPGUIDE_NO_INTRINSICS builds the plain C of every kernel
 * (the same bits: the intrinsics repeat its IEEE operations, tests/test_kernels_simd_tile.py). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(TPGUIDE_NO_INTRINSICS)
#define USE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(TPGUIDE_NO_INTRINSICS)
#define USE_AVX2 1
#endif

/* Software prefetch of the cache lines of [p, p + n), for the streams the hardware prefetcher serves
 * badly at decode sizes (weight panels, paged KV rows: it stops at 4 KiB pages); no effect on any
 * value, and a prefetch past the end of an array is harmless (it never faults). */
static inline __attribute__((always_inline)) void prefetch_bytes(const char *p, int64_t n) {
    const char *line = (const char *)((uintptr_t)p & ~(uintptr_t)63);
    for (; line < p + n; line += 64) __builtin_prefetch(line, 0, 3);
}
#define PREFETCH_KEYS 16  /* attention: cache rows read this many keys ahead */
#define PREFETCH_PAIRS 64 /* VDPBF16PS tiles: weight k pairs ahead (8 KiB; summed units: at most a unit, into the next) */
#define PREFETCH_ROWS 16  /* AVX-512 and AVX2 fmaf tiles: weight k rows ahead (1-2 KiB) */

#define NB 32   /* columns per weight panel */
#define MR 8    /* rows per register tile */
#define LANES 16 /* lanes of the fixed dot-product order (attention, norms) */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> bf16 as torch's .to(torch.bfloat16) (c10::detail::round_to_nearest_even): round to
 * nearest, ties to even; NaN -> 0x7FC0 (a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded; /* a select, not a branch: vectorisable */
}

/* v rounded to bf16 and widened back: the value a bf16 tensor holds after torch's store. */
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* out[i] = v, rounded to bf16 (as torch's cast) where dtype is 2. */
static inline void store_elem(void *out, int64_t dtype, int64_t i, float v) {
    if (dtype == 0)
        ((float *)out)[i] = v;
    else
        ((uint16_t *)out)[i] = f32_to_bf16(v);
}

/* A tile is rows [0, mr) x the NB columns of one packed panel of one unit, accumulated from 0:
 * acc[r][j] = fma chain over k of x[r][k] * w[k * ldw + j]. */
#if defined(USE_AVX512)
#include <immintrin.h>
/* AVX-512: one zmm lane per output column, the rows' accumulators in registers; the same fma per
 * element as the portable tile below, so the bits do not depend on which one runs. */
static inline __attribute__((always_inline)) void load_w_f32(const float *w, __mmask16 m0, __mmask16 m1,
                                                             __m512 *w0, __m512 *w1) {
    *w0 = _mm512_maskz_loadu_ps(m0, w);
    *w1 = _mm512_maskz_loadu_ps(m1, w + 16);
}
static inline __attribute__((always_inline)) void load_w_bf16(const uint16_t *w, __mmask16 m0, __mmask16 m1,
                                                              __m512 *w0, __m512 *w1) {
    __m256i h0 = _mm256_maskz_loadu_epi16(m0, (const void *)w);
    __m256i h1 = _mm256_maskz_loadu_epi16(m1, (const void *)(w + 16));
    *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
    *w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
}
#define DEFINE_TILE(NAME, WTYPE, LOADW)                                                             \
    static inline __attribute__((always_inline)) void NAME##_rows(const int mr, const float *x,     \
            int64_t ldx, const WTYPE *w, int64_t ldw, int64_t K, int nb, float acc_out[MR][NB]) {    \
        const __mmask16 m0 = nb >= 16 ? 0xFFFF : (__mmask16)((1u << nb) - 1);                        \
        const __mmask16 m1 = nb >= 32 ? 0xFFFF : nb <= 16 ? 0 : (__mmask16)((1u << (nb - 16)) - 1);  \
        __m512 a0[MR], a1[MR];                                                                       \
        for (int r = 0; r < mr; r++) a0[r] = a1[r] = _mm512_setzero_ps();                            \
        for (int64_t k = 0; k < K; k++) {                                                            \
            __m512 w0, w1;                                                                           \
            prefetch_bytes((const char *)(w + (k + PREFETCH_ROWS) * ldw), NB * sizeof(WTYPE));       \
            LOADW(w + k * ldw, m0, m1, &w0, &w1);                                                    \
            for (int r = 0; r < mr; r++) {                                                           \
                const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);                                    \
                a0[r] = _mm512_fmadd_ps(xv, w0, a0[r]);                                              \
                a1[r] = _mm512_fmadd_ps(xv, w1, a1[r]);                                              \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < mr; r++) {                                                               \
            _mm512_storeu_ps(acc_out[r], a0[r]);                                                     \
            _mm512_storeu_ps(acc_out[r] + 16, a1[r]);                                                \
        }                                                                                            \
    }                                                                                                \
    static void NAME(int mr, const float *x, int64_t ldx, const WTYPE *w, int64_t ldw, int64_t K,    \
                     int nb, float acc_out[MR][NB]) {                                                \
        switch (mr) {                                                                                \
        case 8: NAME##_rows(8, x, ldx, w, ldw, K, nb, acc_out); break;                               \
        case 7: NAME##_rows(7, x, ldx, w, ldw, K, nb, acc_out); break;                               \
        case 6: NAME##_rows(6, x, ldx, w, ldw, K, nb, acc_out); break;                               \
        case 5: NAME##_rows(5, x, ldx, w, ldw, K, nb, acc_out); break;                               \
        case 4: NAME##_rows(4, x, ldx, w, ldw, K, nb, acc_out); break;                               \
        case 3: NAME##_rows(3, x, ldx, w, ldw, K, nb, acc_out); break;                               \
        case 2: NAME##_rows(2, x, ldx, w, ldw, K, nb, acc_out); break;                               \
        default: NAME##_rows(1, x, ldx, w, ldw, K, nb, acc_out); break;                              \
        }                                                                                            \
    }
DEFINE_TILE(tile_f32, float, load_w_f32)
DEFINE_TILE(tile_bf16, uint16_t, load_w_bf16)
#elif defined(USE_AVX2)
/* AVX2 + FMA (16 ymm registers): the panel in two halves of 16 columns (two ymm), each half in groups
 * of up to 4 rows, 8 accumulators in registers; k in blocks of KC so that a half panel's block stays
 * in L1 for the second row group.  An accumulator is stored after one block and reloaded for the
 * next (exact), and _mm256_fmadd_ps is fmaf in every lane, so every element is the portable tile's
 * fma chain, k ascending from 0: the same bits.  bf16 weights are widened exactly (shift left 16). */
#define KC 256
static inline __attribute__((always_inline)) __m256 load8_f32(const float *w) { return _mm256_loadu_ps(w); }
static inline __attribute__((always_inline)) __m256 load8_bf16(const uint16_t *w) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#define DEFINE_TILE(NAME, WTYPE, LOADW)                                                              \
    /* acc[r][0..16) += chain over k in [k0, k1) of x[r][k] * w[k][0..16), r < rows (acc from 0 when  \
     * first), acc's row stride NB. */                                                                \
    static inline __attribute__((always_inline)) void NAME##_group(const int rows, const float *x,   \
            int64_t ldx, const WTYPE *w, int64_t ldw, int64_t k0, int64_t k1, float *acc, int first) { \
        __m256 a0[4], a1[4];                                                                          \
        for (int r = 0; r < rows; r++) {                                                              \
            a0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NB);                       \
            a1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * NB + 8);                   \
        }                                                                                             \
        for (int64_t k = k0; k < k1; k++) {                                                           \
            prefetch_bytes((const char *)(w + (k + PREFETCH_ROWS) * ldw), 16 * sizeof(WTYPE));        \
            const __m256 w0 = LOADW(w + k * ldw), w1 = LOADW(w + k * ldw + 8);                        \
            for (int r = 0; r < rows; r++) {                                                          \
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);                               \
                a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);                                               \
                a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);                                               \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < rows; r++) {                                                              \
            _mm256_storeu_ps(acc + r * NB, a0[r]);                                                    \
            _mm256_storeu_ps(acc + r * NB + 8, a1[r]);                                                \
        }                                                                                             \
    }                                                                                                 \
    static void NAME(int mr, const float *x, int64_t ldx, const WTYPE *w, int64_t ldw, int64_t K,    \
                     int nb, float acc_out[MR][NB]) {                                                 \
        (void)nb; /* all NB columns: the panel is zero past N */                                      \
        int64_t k0 = 0;                                                                               \
        do {                                                                                          \
            const int64_t k1 = K - k0 < KC ? K : k0 + KC;                                             \
            for (int h = 0; h < NB; h += 16)                                                          \
                for (int r0 = 0; r0 < mr; r0 += 4) {                                                  \
                    const float *xr = x + r0 * ldx;                                                   \
                    float *acc = &acc_out[r0][h];                                                     \
                    switch (mr - r0 < 4 ? mr - r0 : 4) {                                              \
                    case 4: NAME##_group(4, xr, ldx, w + h, ldw, k0, k1, acc, k0 == 0); break;        \
                    case 3: NAME##_group(3, xr, ldx, w + h, ldw, k0, k1, acc, k0 == 0); break;        \
                    case 2: NAME##_group(2, xr, ldx, w + h, ldw, k0, k1, acc, k0 == 0); break;        \
                    default: NAME##_group(1, xr, ldx, w + h, ldw, k0, k1, acc, k0 == 0); break;       \
                    }                                                                                 \
                }                                                                                     \
            k0 = k1;                                                                                  \
        } while (k0 < K);                                                                             \
    }
DEFINE_TILE(tile_f32, float, load8_f32)
DEFINE_TILE(tile_bf16, uint16_t, load8_bf16)
#else
/* Portable tile (the compiler vectorises the loop over columns; fmaf is exact either way). */
#define DEFINE_TILE(NAME, WTYPE, LOADW)                                                              \
    static void NAME(int mr, const float *x, int64_t ldx, const WTYPE *w, int64_t ldw, int64_t K,   \
                     int nb, float acc_out[MR][NB]) {                                                 \
        float acc[MR][NB];                                                                            \
        for (int r = 0; r < MR; r++)                                                                  \
            for (int j = 0; j < NB; j++) acc[r][j] = 0.0f;                                            \
        for (int64_t k = 0; k < K; k++) {                                                             \
            float wk[NB];                                                                             \
            for (int j = 0; j < NB; j++) wk[j] = j < nb ? LOADW(w[k * ldw + j]) : 0.0f;               \
            for (int r = 0; r < mr; r++) {                                                            \
                const float xv = x[r * ldx + k];                                                      \
                for (int j = 0; j < NB; j++) acc[r][j] = fmaf(xv, wk[j], acc[r][j]);                  \
            }                                                                                         \
        }                                                                                             \
        memcpy(acc_out, acc, sizeof(acc));                                                            \
    }
#define LOAD_F32(v) (v)
#define LOAD_BF16(v) bf16_to_f32(v)
DEFINE_TILE(tile_f32, float, LOAD_F32)
DEFINE_TILE(tile_bf16, uint16_t, LOAD_BF16)
#endif

/* Rows [0, mr) x columns [0, nb) of a tile into out [.., N] at (m0, n0), fp32 (out_dtype 0) or
 * rounded to bf16 (2). */
static inline void store_tile(float (*tile)[NB], void *out, int64_t out_dtype, int64_t N, int64_t m0, int64_t n0,
                              int mr, int nb) {
    if (out_dtype == 0) {
        float *o = (float *)out;
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nb; j++) o[(m0 + r) * N + n0 + j] = tile[r][j];
    } else {
        uint16_t *o = (uint16_t *)out;
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nb; j++) o[(m0 + r) * N + n0 + j] = f32_to_bf16(tile[r][j]);
    }
}

/* A unit's tile is done: stored as its own partial (unit_out = out + u * M * N), or added to the
 * running total in unit order (the first unit copied, so no 0 + x). */
static inline void unit_done(float (*acc)[NB], float (*total)[NB], int64_t u, int64_t sum_units, float *unit_out,
                             int64_t N, int64_t m0, int64_t n0, int mr, int nb) {
    if (!sum_units) {
        store_tile(acc, unit_out, 0, N, m0, n0, mr, nb);
    } else {
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < NB; j++) total[r][j] = u == 0 ? acc[r][j] : total[r][j] + acc[r][j];
    }
}

/* x: [M, ldx] fp32 (unit u reads columns [u*K_unit, (u+1)*K_unit)); w: packed panels
 * [U][P = ceil(N / NB)][K_unit][NB] (zero past N), fp32 (w_dtype 0) or bf16 (2); sum_units != 0: out fp32 [M, N] = the units added in order; else out fp32
 * [U, M, N] (one partial per unit).  out_dtype 2 (sum_units only): out bf16 [M, N], each fp32 sum
 * rounded as torch's cast.  Returns 0, or -1 for an unknown weight or output dtype. */
int tpguide_linear_units(const float *x, int64_t M, int64_t ldx, const void *w, int64_t w_dtype,
                         int64_t K_unit, int64_t U, int64_t N, void *out, int64_t out_dtype, int64_t sum_units,
                         int64_t num_threads) {
    if ((w_dtype != 0 && w_dtype != 2) || (out_dtype != 0 && (out_dtype != 2 || !sum_units))) return -1;
    const int64_t P = (N + NB - 1) / NB;
    const int64_t R = (M + MR - 1) / MR;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < P; p++) {
        for (int64_t rb = 0; rb < R; rb++) {
            const int64_t m0 = rb * MR;
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            const int64_t n0 = p * NB;
            const int nb = (int)(N - n0 < NB ? N - n0 : NB);
            float acc[MR][NB];
            float total[MR][NB];
            memset(acc, 0, sizeof(acc));
            for (int64_t u = 0; u < U; u++) {
                const float *xu = x + m0 * ldx + u * K_unit;
                const int64_t off = (u * P + p) * K_unit * NB;
                if (w_dtype == 0)
                    tile_f32(mr, xu, ldx, (const float *)w + off, NB, K_unit, NB, acc);
                else
                    tile_bf16(mr, xu, ldx, (const uint16_t *)w + off, NB, K_unit, NB, acc);
                unit_done(acc, total, u, sum_units, sum_units ? (float *)out : (float *)out + u * M * N, N, m0, n0,
                          mr, nb);
            }
            if (sum_units) store_tile(total, out, out_dtype, N, m0, n0, mr, nb);
        }
    }
    return 0;
}

/* out[i] = ((p[0][i] + p[1][i]) + p[2][i]) + ... over U rows of numel elements: the units' order.
 * init != NULL: ((init[i] + p[0][i]) + p[1][i]) + ..., a running sum carried on from earlier units. */
void tpguide_sum_units(const float *partials, int64_t U, int64_t numel, float *out, int64_t num_threads,
                       const float *init) {
    const int64_t chunk = 4096;
    const int64_t C = (numel + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < C; c++) {
        const int64_t lo = c * chunk, hi = lo + chunk < numel ? lo + chunk : numel;
        if (init)
            for (int64_t i = lo; i < hi; i++) out[i] = init[i] + partials[i];
        else
            for (int64_t i = lo; i < hi; i++) out[i] = partials[i];
        for (int64_t u = 1; u < U; u++) {
            const float *pu = partials + u * numel;
            for (int64_t i = lo; i < hi; i++) out[i] += pu[i];
        }
    }
}

/* The fixed dot-product order: lane l accumulates d = l, l+16, ... with fmaf, then the 16 lanes are
 * added as a fixed binary tree.  a, b fp32 [D]. */
static inline float dot_fixed(const float *a, const float *b, int64_t D) {
    float lane[LANES];
    for (int l = 0; l < LANES; l++) lane[l] = 0.0f;
    int64_t d0 = 0;
    for (; d0 + LANES <= D; d0 += LANES)
        for (int l = 0; l < LANES; l++) lane[l] = fmaf(a[d0 + l], b[d0 + l], lane[l]);
    for (int l = 0; d0 + l < D; l++) lane[l] = fmaf(a[d0 + l], b[d0 + l], lane[l]);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] = lane[l] + lane[l + w];
    return lane[0];
}

static inline void load_row(const void *src, int64_t dtype, int64_t D, float *dst) {
    if (dtype == 0) {
        memcpy(dst, src, (size_t)D * 4);
    } else {
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(h[d]);
    }
}

#define MAX_HEAD_DIM 512
#define MAX_ROWS 64 /* query rows (tokens x heads of one KV head) per attention work item */

/* exp(x) for x <= 0 by Cody-Waite range reduction and Cephes' expf polynomial, in plain float
 * arithmetic only (no libm, no fma contraction), so every element gets the same bits whether the
 * compiler vectorises the loop or not; about 1 ulp; exactly 0 below -87.3. */
static inline float exp_nonpositive(float x) {
    const float xc = x < -87.3f ? -87.3f : x;
    const float z = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - z * 0.693359375f;
    r = r - z * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)z + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.3f ? 0.0f : p * scale;
}

#if defined(USE_AVX512)
/* exp_nonpositive on 16 lanes: the same IEEE operations in the same order, so the scalar bits. */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 floor_x = _mm512_set1_ps(-87.3f);
    const __m512 xc = _mm512_max_ps(x, floor_x);
    const __m512 z = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(z, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(z, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(z), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    const __mmask16 under = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
    return _mm512_mask_blend_ps(under, e, _mm512_setzero_ps());
}
#elif defined(USE_AVX2)
/* exp_nonpositive on 8 lanes: the same IEEE operations in the same order, so the scalar bits
 * (max(-87.3, x) keeps a NaN x, as the scalar select does). */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.3f);
    const __m256 xc = _mm256_max_ps(floor_x, x);
    const __m256 z = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                                   _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(xc, _mm256_mul_ps(z, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(z, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(z), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ));
}
#endif

/* sr[j] = exp_nonpositive(sr[j] - m) for j in [lo, hi], 16 lanes at a time where the CPU has AVX-512. */
static inline void exp_shifted(float *sr, int64_t lo, int64_t hi, float m) {
    int64_t j = lo;
#if defined(USE_AVX512)
    const __m512 vm = _mm512_set1_ps(m);
    for (; j + 16 <= hi + 1; j += 16) _mm512_storeu_ps(sr + j, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), vm)));
#elif defined(USE_AVX2)
    const __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= hi + 1; j += 8) _mm256_storeu_ps(sr + j, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), vm)));
#endif
    for (; j <= hi; j++) sr[j] = exp_nonpositive(sr[j] - m);
}

/* SiLU x * sigmoid(x) with e = exp_nonpositive(-|x|): x / (1 + e) for x >= 0, x * e / (1 + e) below
 * (never an overflowing exp); pure arithmetic, the same bits in every lane. */
static inline float silu_fixed(float x) {
    const float e = exp_nonpositive(x >= 0.0f ? -x : x);
    return x >= 0.0f ? x / (1.0f + e) : x * e / (1.0f + e);
}

static void silu_array(const float *x, float *out, int64_t lo, int64_t hi) {
    int64_t i = lo;
#if defined(USE_AVX512)
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (; i + 16 <= hi; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 neg = _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ);
        const __m512 nabs = _mm512_mask_blend_ps(neg, _mm512_sub_ps(zero, v), v); /* -|x| */
        const __m512 e = exp_nonpositive16(nabs);
        const __m512 den = _mm512_add_ps(one, e);
        const __m512 pos_r = _mm512_div_ps(v, den);
        const __m512 neg_r = _mm512_div_ps(_mm512_mul_ps(v, e), den);
        _mm512_storeu_ps(out + i, _mm512_mask_blend_ps(neg, pos_r, neg_r));
    }
#elif defined(USE_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= hi; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 neg = _mm256_cmp_ps(v, zero, _CMP_LT_OQ);
        const __m256 e = exp_nonpositive8(_mm256_blendv_ps(_mm256_sub_ps(zero, v), v, neg)); /* -|x| */
        const __m256 den = _mm256_add_ps(one, e);
        const __m256 pos_r = _mm256_div_ps(v, den);
        const __m256 neg_r = _mm256_div_ps(_mm256_mul_ps(v, e), den);
        _mm256_storeu_ps(out + i, _mm256_blendv_ps(pos_r, neg_r, neg));
    }
#endif
    for (; i < hi; i++) out[i] = silu_fixed(x[i]);
}

/* Causal attention of T query tokens over a paged KV cache.
 * q: [T, H, D] (dtype); k_cache/v_cache: [num_blocks, block_size, Hkv, D] (dtype); block_tables:
 * int64 [num_seqs, max_blocks], cache position j of sequence s lives in block
 * block_tables[s][j / block_size] at row j % block_size (a dense per-slot cache is block_size =
 * max_model_len and one block, the slot, per sequence); token_seq / token_pos: int64 [T], a
 * sequence's tokens consecutive with positions ascending, as the flattened batch has them.
 * Token t, head h reads KV head h / (H / Hkv) at positions j in [lo, pos_t], lo = 0 or
 * pos_t - window + 1.  Per (t, h):
 *   s_j = (fmaf chain over d ascending of q[d] * k_j[d]) * scale (soft-capped if softcap > 0),
 *   m = max_j s_j, p_j = exp_nonpositive(s_j - m),
 *   l = 16 lane sums (lane j % 16 adds its p_j in ascending j) added as the fixed binary tree,
 *   o[d] = fmaf chain of p_j * v_j[d] in ascending j,  out = o / l.
 * Work items are runs of consecutive tokens of one sequence times the query heads of one KV head.
 * An item widens its keys (transposed, [D][J]) and values ([J][D]) once, from a 16-aligned first
 * key, then computes register blocks of 4 rows x 64 keys (scores) and 4 rows x 64 dims (P V).  A
 * block covers the union of its rows' key ranges; a row's p_j outside its own range are exact zeros,
 * which leave its lane sums and fma chains unchanged (x + 0 = x, fmaf(0, v, o) = o), so every
 * element is the one above whatever the item, the batch, the vector width or the thread.
 * scratch: fp32 [num_threads, attention_scratch_floats(L, D)], L = largest position + 1.
 * out: fp32 [T, H, D].  dtype: 0 fp32, 2 bf16.  Returns 0, or -1 for bad arguments. */
#define KEYS 16
#define RB 4         /* query rows per register block */
#define KB 4         /* key vectors (of KEYS) per score block */
#define DB 4         /* head-dim vectors (of 16) per P V block */
#define KEY_GROUP (KB * KEYS)

static const float ZERO_ROW[MAX_HEAD_DIM]; /* a padding key: zeros */

/* kt[d * ld + l] = rows[l][d] for the KEYS rows and d < D: pure data movement (the same bits on every
 * path).  AVX2: 8 x 8 blocks by unpack / shuffle / lane permute; the rest element by element. */
static inline void transpose_keys(const float *const rows[KEYS], int64_t D, float *kt, int64_t ld) {
    int64_t d0 = 0;
#ifdef USE_AVX2
    for (; d0 + 8 <= D; d0 += 8)
        for (int h = 0; h < KEYS; h += 8) {
            const float *const *r = rows + h;
            const __m256 t0 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[0] + d0), _mm256_loadu_ps(r[1] + d0));
            const __m256 t1 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[0] + d0), _mm256_loadu_ps(r[1] + d0));
            const __m256 t2 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[2] + d0), _mm256_loadu_ps(r[3] + d0));
            const __m256 t3 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[2] + d0), _mm256_loadu_ps(r[3] + d0));
            const __m256 t4 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[4] + d0), _mm256_loadu_ps(r[5] + d0));
            const __m256 t5 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[4] + d0), _mm256_loadu_ps(r[5] + d0));
            const __m256 t6 = _mm256_unpacklo_ps(_mm256_loadu_ps(r[6] + d0), _mm256_loadu_ps(r[7] + d0));
            const __m256 t7 = _mm256_unpackhi_ps(_mm256_loadu_ps(r[6] + d0), _mm256_loadu_ps(r[7] + d0));
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
            const __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
            float *o = kt + d0 * ld + h;
            _mm256_storeu_ps(o + 0 * ld, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + 1 * ld, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
#endif
    for (; d0 < D; d0++)
        for (int l = 0; l < KEYS; l++) kt[d0 * ld + l] = rows[l][d0];
}

/* Widened keys per item: from a 16-aligned first key, rounded up to whole score blocks. */
static int64_t padded_keys(int64_t L) { return (L + KEYS - 1 + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP; }

int64_t tpguide_attention_scratch_floats(int64_t L, int64_t D) {
    const int64_t jp = padded_keys(L);
    return 2 * jp * D + MAX_ROWS * jp + MAX_ROWS * D;
}

/* s[r][l + 16 b] = fma chain over d of q[r][d] * kt[d * ld + 16 b + l], r < rb, b < kb. */
static inline __attribute__((always_inline)) void score_block(const float *q, int64_t D, const float *kt, int64_t ld,
                                                              float *s, int64_t lds, int rb, int kb) {
#if defined(USE_AVX512)
    __m512 acc[RB][KB];
    for (int r = 0; r < rb; r++)
        for (int b = 0; b < kb; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m512 k[KB];
        for (int b = 0; b < kb; b++) k[b] = _mm512_loadu_ps(kt + d * ld + b * KEYS);
        for (int r = 0; r < rb; r++) {
            const __m512 qd = _mm512_set1_ps(q[r * D + d]);
            for (int b = 0; b < kb; b++) acc[r][b] = _mm512_fmadd_ps(qd, k[b], acc[r][b]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int b = 0; b < kb; b++) _mm512_storeu_ps(s + r * lds + b * KEYS, acc[r][b]);
#elif defined(USE_AVX2)
    for (int b = 0; b < kb; b++) { /* 16 keys (two ymm) x rb rows at a time: at most 8 accumulators */
        __m256 a0[RB], a1[RB];
        for (int r = 0; r < rb; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m256 k0 = _mm256_loadu_ps(kt + d * ld + b * KEYS), k1 = _mm256_loadu_ps(kt + d * ld + b * KEYS + 8);
            for (int r = 0; r < rb; r++) {
                const __m256 qd = _mm256_broadcast_ss(q + r * D + d);
                a0[r] = _mm256_fmadd_ps(qd, k0, a0[r]);
                a1[r] = _mm256_fmadd_ps(qd, k1, a1[r]);
            }
        }
        for (int r = 0; r < rb; r++) {
            _mm256_storeu_ps(s + r * lds + b * KEYS, a0[r]);
            _mm256_storeu_ps(s + r * lds + b * KEYS + 8, a1[r]);
        }
    }
#else
    float acc[RB][KEY_GROUP];
    for (int r = 0; r < rb; r++)
        for (int l = 0; l < kb * KEYS; l++) acc[r][l] = 0.0f;
    for (int64_t d = 0; d < D; d++)
        for (int r = 0; r < rb; r++)
            for (int l = 0; l < kb * KEYS; l++) acc[r][l] = fmaf(q[r * D + d], kt[d * ld + l], acc[r][l]);
    for (int r = 0; r < rb; r++)
        for (int l = 0; l < kb * KEYS; l++) s[r * lds + l] = acc[r][l];
#endif
}

/* o[r][d0 + e] = fma chain over j in [j0, j1] of p[r][j] * vf[j][d0 + e], e < dn <= 16 nv, r < rb. */
static inline __attribute__((always_inline)) void pv_block(const float *p, int64_t ldp, const float *vf, int64_t D,
                                                           int64_t d0, int64_t dn, int64_t j0, int64_t j1, float *o,
                                                           int rb, int nv) {
#if defined(USE_AVX512)
    __mmask16 mask[DB];
    for (int b = 0; b < nv; b++) {
        const int64_t left = dn - 16 * b;
        mask[b] = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    }
    __m512 acc[RB][DB];
    for (int r = 0; r < rb; r++)
        for (int b = 0; b < nv; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t j = j0; j <= j1; j++) {
        __m512 v[DB];
        for (int b = 0; b < nv; b++) v[b] = _mm512_maskz_loadu_ps(mask[b], vf + j * D + d0 + 16 * b);
        for (int r = 0; r < rb; r++) {
            const __m512 pj = _mm512_set1_ps(p[r * ldp + j]);
            for (int b = 0; b < nv; b++) acc[r][b] = _mm512_fmadd_ps(pj, v[b], acc[r][b]);
        }
    }
    for (int r = 0; r < rb; r++)
        for (int b = 0; b < nv; b++) _mm512_mask_storeu_ps(o + r * D + d0 + 16 * b, mask[b], acc[r][b]);
#elif defined(USE_AVX2)
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int b = 0; b < nv; b++) { /* 16 dims (two ymm, masked past dn) x rb rows at a time */
        const float *vb = vf + d0 + 16 * b;
        const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(dn - 16 * b)), lane);
        const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(dn - 16 * b - 8)), lane);
        __m256 a0[RB], a1[RB];
        for (int r = 0; r < rb; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int64_t j = j0; j <= j1; j++) {
            const __m256 v0 = _mm256_maskload_ps(vb + j * D, m0), v1 = _mm256_maskload_ps(vb + j * D + 8, m1);
            for (int r = 0; r < rb; r++) {
                const __m256 pj = _mm256_broadcast_ss(p + r * ldp + j);
                a0[r] = _mm256_fmadd_ps(pj, v0, a0[r]);
                a1[r] = _mm256_fmadd_ps(pj, v1, a1[r]);
            }
        }
        for (int r = 0; r < rb; r++) {
            _mm256_maskstore_ps(o + r * D + d0 + 16 * b, m0, a0[r]);
            _mm256_maskstore_ps(o + r * D + d0 + 16 * b + 8, m1, a1[r]);
        }
    }
#else
    (void)nv;
    float acc[RB][16 * DB];
    for (int r = 0; r < rb; r++)
        for (int64_t e = 0; e < dn; e++) acc[r][e] = 0.0f;
    for (int64_t j = j0; j <= j1; j++)
        for (int r = 0; r < rb; r++) {
            const float pj = p[r * ldp + j];
            for (int64_t e = 0; e < dn; e++) acc[r][e] = fmaf(pj, vf[j * D + d0 + e], acc[r][e]);
        }
    for (int r = 0; r < rb; r++)
        for (int64_t e = 0; e < dn; e++) o[r * D + d0 + e] = acc[r][e];
#endif
}

/* Constant rb / kb for the register blocks (always_inline unrolls them). */
static void score_block_any(const float *q, int64_t D, const float *kt, int64_t ld, float *s, int64_t lds, int rb,
                            int kb) {
#define SB(R)                                                                  \
    switch (kb) {                                                              \
    case 1: score_block(q, D, kt, ld, s, lds, R, 1); break;                    \
    case 2: score_block(q, D, kt, ld, s, lds, R, 2); break;                    \
    case 3: score_block(q, D, kt, ld, s, lds, R, 3); break;                    \
    default: score_block(q, D, kt, ld, s, lds, R, 4); break;                   \
    }
    switch (rb) {
    case 1: SB(1); break;
    case 2: SB(2); break;
    case 3: SB(3); break;
    default: SB(4); break;
    }
#undef SB
}

static void pv_block_any(const float *p, int64_t ldp, const float *vf, int64_t D, int64_t d0, int64_t dn, int64_t j0,
                         int64_t j1, float *o, int rb) {
    const int nv = (int)((dn + 15) / 16);
#define PB(R)                                                                  \
    switch (nv) {                                                              \
    case 1: pv_block(p, ldp, vf, D, d0, dn, j0, j1, o, R, 1); break;           \
    case 2: pv_block(p, ldp, vf, D, d0, dn, j0, j1, o, R, 2); break;           \
    case 3: pv_block(p, ldp, vf, D, d0, dn, j0, j1, o, R, 3); break;           \
    default: pv_block(p, ldp, vf, D, d0, dn, j0, j1, o, R, 4); break;          \
    }
    switch (rb) {
    case 1: PB(1); break;
    case 2: PB(2); break;
    case 3: PB(3); break;
    default: PB(4); break;
    }
#undef PB
}

/* sr[j] *= scale (soft-capped if softcap > 0) for j in [lo, hi]; returns their maximum (order-free). */
static inline float scale_and_max(float *sr, int64_t lo, int64_t hi, float scale, float softcap) {
    float m = -INFINITY;
    int64_t j = lo;
    if (softcap > 0.0f) {
        for (; j <= hi; j++) {
            const float sj = softcap * tanhf(sr[j] * scale / softcap);
            sr[j] = sj;
            m = sj > m ? sj : m;
        }
        return m;
    }
#if defined(USE_AVX512)
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= hi + 1; j += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sr + j), vs);
        _mm512_storeu_ps(sr + j, v);
        vmax = _mm512_max_ps(vmax, v);
    }
    m = _mm512_reduce_max_ps(vmax);
#endif
    for (; j <= hi; j++) {
        const float sj = sr[j] * scale;
        sr[j] = sj;
        m = sj > m ? sj : m;
    }
    return m;
}

/* The 16 lane sums of p[c0 .. c1) (c0, c1 multiples of 16), added as the fixed tree. */
static inline float lane_sum(const float *p, int64_t c0, int64_t c1) {
    float lane[LANES];
    for (int l = 0; l < LANES; l++) lane[l] = 0.0f;
#if defined(USE_AVX512)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = c0; j < c1; j += LANES) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + j));
    _mm512_storeu_ps(lane, acc);
#else
    for (int64_t j = c0; j < c1; j += LANES)
        for (int l = 0; l < LANES; l++) lane[l] = lane[l] + p[j + l];
#endif
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] = lane[l] + lane[l + w];
    return lane[0];
}

static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

int tpguide_attention(const void *q, const void *k_cache, const void *v_cache, int64_t dtype,
                      const int64_t *block_tables, int64_t num_seqs, int64_t max_blocks, int64_t block_size,
                      int64_t num_blocks, const int64_t *token_seq, const int64_t *token_pos, int64_t T, int64_t H,
                      int64_t Hkv, int64_t D, int64_t L, float scale, int64_t window, float softcap, float *scratch,
                      void *out, int64_t out_dtype, int64_t num_threads) {
    if ((dtype != 0 && dtype != 2) || (out_dtype != 0 && out_dtype != 2) || D > MAX_HEAD_DIM || H % Hkv || H / Hkv > MAX_ROWS || block_size < 1) return -1;
    for (int64_t t = 0; t < T; t++)
        if (token_seq[t] < 0 || token_seq[t] >= num_seqs || token_pos[t] < 0 || token_pos[t] >= L ||
            token_pos[t] >= max_blocks * block_size)
            return -1;
    for (int64_t t = 0; t < T; t++) /* every block a token reads is in the pool */
        if (t + 1 == T || token_seq[t + 1] != token_seq[t])
            for (int64_t b = 0; b <= token_pos[t] / block_size; b++) {
                const int64_t blk = block_tables[token_seq[t] * max_blocks + b];
                if (blk < 0 || blk >= num_blocks) return -1;
            }
    const int64_t group = H / Hkv;
    const int64_t qb = MAX_ROWS / group; /* tokens per work item */
    const int64_t esize = dtype == 0 ? 4 : 2;
    const int64_t JP = padded_keys(L);
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(T + 1));
    if (!starts) return -1;
    int64_t nb = 0;
    for (int64_t t = 0; t < T;) { /* runs of <= qb consecutive tokens of one sequence */
        int64_t e = t + 1;
        while (e < T && e - t < qb && token_seq[e] == token_seq[t] && token_pos[e] == token_pos[e - 1] + 1) e++;
        starts[nb++] = t;
        t = e;
    }
    starts[nb] = T;
    const int64_t jstride = Hkv * D * esize; /* bytes from one cache row to the next */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            const int64_t t0 = starts[b], rows = (starts[b + 1] - t0) * group;
            const int64_t *table = block_tables + token_seq[t0] * max_blocks;
            float *kt = scratch + (int64_t)tid * tpguide_attention_scratch_floats(L, D); /* [D][jnp] */
            float *vf = kt + JP * D;                                                     /* [jnp][D] */
            float *s = vf + JP * D;                                                      /* [rows][jnp] */
            float *qf = s + MAX_ROWS * JP;                                               /* [rows][D] */
            int64_t jlo = first_key(token_pos[t0], window), jhi = token_pos[starts[b + 1] - 1];
            jlo -= jlo % KEYS;
            const int64_t jn = jhi - jlo + 1, jnp = (jn + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
            float block[KEYS][MAX_HEAD_DIM];
            const float *krow[KEYS]; /* each key's fp32 row: the cache row itself (fp32) or widened */
            for (int64_t j0 = 0; j0 < jnp; j0 += KEYS) { /* keys widened 16 at a time, then transposed */
                for (int l = 0; l < KEYS; l++) {
                    const int64_t j = j0 + l, pos = jlo + j;
                    if (j < jn) {
                        if (j + PREFETCH_KEYS < jn) { /* the cache rows PREFETCH_KEYS keys ahead */
                            const int64_t pp = pos + PREFETCH_KEYS;
                            const int64_t prow = table[pp / block_size] * block_size + pp % block_size;
                            prefetch_bytes((const char *)k_cache + prow * jstride + kvh * D * esize, D * esize);
                            prefetch_bytes((const char *)v_cache + prow * jstride + kvh * D * esize, D * esize);
                        }
                        const int64_t row = table[pos / block_size] * block_size + pos % block_size;
                        const char *ksrc = (const char *)k_cache + row * jstride + kvh * D * esize;
                        if (dtype == 0) {
                            krow[l] = (const float *)ksrc;
                        } else {
                            load_row(ksrc, dtype, D, block[l]);
                            krow[l] = block[l];
                        }
                        load_row((const char *)v_cache + row * jstride + kvh * D * esize, dtype, D, vf + j * D);
                    } else {
                        krow[l] = ZERO_ROW;
                        for (int64_t d = 0; d < D; d++) vf[j * D + d] = 0.0f;
                    }
                }
                transpose_keys(krow, D, kt + j0, jnp);
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t t = t0 + r / group, h = kvh * group + r % group;
                load_row((const char *)q + (t * H + h) * D * esize, dtype, D, qf + r * D);
            }
            for (int64_t r0 = 0; r0 < rows; r0 += RB) {
                const int rb = rows - r0 < RB ? (int)(rows - r0) : RB;
                /* the block's key range [c0, c1): union of its rows', 16-aligned, relative to jlo */
                const int64_t c0 = first_key(token_pos[t0 + r0 / group], window) - jlo;
                const int64_t last = token_pos[t0 + (r0 + rb - 1) / group] - jlo;
                const int64_t c0a = c0 - c0 % KEYS, c1 = (last / KEYS + 1) * KEYS;
                float *sb = s + r0 * jnp;
                for (int64_t j0 = c0a; j0 < c1; j0 += KEY_GROUP) {
                    const int64_t left = (c1 - j0) / KEYS;
                    score_block_any(qf + r0 * D, D, kt + j0, jnp, sb + j0, jnp, rb, left < KB ? (int)left : KB);
                }
                float inv_l[RB];
                for (int r = 0; r < rb; r++) {
                    const int64_t pos = token_pos[t0 + (r0 + r) / group];
                    const int64_t lo = first_key(pos, window) - jlo, hi = pos - jlo;
                    float *sr = sb + r * jnp;
                    exp_shifted(sr, lo, hi, scale_and_max(sr, lo, hi, scale, softcap));
                    for (int64_t j = c0a; j < lo; j++) sr[j] = 0.0f;
                    for (int64_t j = hi + 1; j < c1; j++) sr[j] = 0.0f;
                    inv_l[r] = lane_sum(sr, c0a, c1);
                }
                float o[RB * MAX_HEAD_DIM];
                for (int64_t d0 = 0; d0 < D; d0 += 16 * DB) {
                    const int64_t dn = D - d0 < 16 * DB ? D - d0 : 16 * DB;
                    pv_block_any(sb, jnp, vf, D, d0, dn, c0a, last, o, rb);
                }
                for (int r = 0; r < rb; r++) {
                    const int64_t t = t0 + (r0 + r) / group, h = kvh * group + (r0 + r) % group;
                    const int64_t base = (t * H + h) * D;
                    for (int64_t d = 0; d < D; d++) store_elem(out, out_dtype, base + d, o[r * D + d] / inv_l[r]);
                }
            }
        }
    }
    free(starts);
    return 0;
}

/* RMS statistics: mean_square[t] = dot(x[t], x[t]) / D with the fixed dot order; x fp32 [T, D]. */
void tpguide_mean_square(const float *x, int64_t T, int64_t D, float *mean_square, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const float *row = x + t * D;
        mean_square[t] = dot_fixed(row, row, D) / (float)D;
    }
}

/* Element-wise functions with scalar libm calls only (never a vector approximation), so an element's
 * value does not depend on where it sits in the tensor, on the tensor's size or on the thread split.
 * op 0: silu (silu_fixed: the pure-arithmetic exp, vectorised with the same bits); 1: tanh-GELU 0.5 x (1 + tanhf(sqrt(2/pi) (x + 0.044715 x^3)));
 * 2: soft-cap c * tanhf(x / c); 3: cosf; 4: sinf.  x, out fp32 [n]. */
/* One element of tpguide_unary's ops 1-4 (scalar libm calls only). */
static inline float unary_scalar(float v, int64_t op, float param) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    switch (op) {
    case 1: return 0.5f * v * (1.0f + tanhf(beta * (v + kappa * (v * v * v))));
    case 2: return param * tanhf(v / param);
    case 3: return cosf(v);
    default: return sinf(v);
    }
}

void tpguide_unary(const float *x, int64_t n, int64_t op, float param, float *out, int64_t num_threads) {
    if (op == 0) {
        const int64_t chunk = 4096, C = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t c = 0; c < C; c++) silu_array(x, out, c * chunk, c * chunk + chunk < n ? c * chunk + chunk : n);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < n; i++) out[i] = unary_scalar(x[i], op, param);
}

/* ---- Fused element-wise kernels of the decoder step (docs/architecture.md §6).  Each reproduces,
 * bit for bit, the torch expression it replaces: the same fp32 operations in the same order, and
 * in bf16 (dtype 2) a rounding to bf16 (round_bf16 / f32_to_bf16) wherever torch stores a bf16
 * tensor.  Rows are independent, one row per thread. ---- */

/* Residual add + RMS norm (vLLM's fused_add_rms_norm).  x, residual (may be NULL), out,
 * residual_out: [T, D] of dtype; weight [D] of dtype; residual_out may be residual itself (a row is
 * read whole into h before its residual_out row is written).  Per row:
 *   h = x + residual (bf16: rounded; without residual h = x), residual_out = h (if not NULL),
 *   ms = dot_fixed(h, h) / D (tpguide_mean_square), r = 1 / sqrtf(ms + eps) (torch.rsqrt),
 *   out = w * (h * r), the product h * r rounded to bf16 first in bf16 mode (RMSNorm's .to(dtype)).
 * Returns 0, or -1 for an unknown dtype or out of memory. */
int tpguide_add_rms_norm(const void *x, const void *residual, const void *weight, int64_t dtype, int64_t T,
                         int64_t D, float eps, void *out, void *residual_out, int64_t num_threads) {
    if (dtype != 0 && dtype != 2) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *h = (float *)malloc(sizeof(float) * (size_t)(D > 0 ? D : 1));
        if (!h) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!h) continue;
            const int64_t base = t * D;
            /* dtype-specialised loops (no per-element dtype test), so the compiler vectorises them */
            if (dtype == 0) {
                const float *res = residual ? (const float *)residual + base : NULL; /* may be residual_out */
                float *restrict o = (float *)out + base;
                const float *restrict w = (const float *)weight;
                load_row((const float *)x + base, 0, D, h);
                if (residual)
                    for (int64_t d = 0; d < D; d++) h[d] = h[d] + res[d];
                if (residual_out) memcpy((float *)residual_out + base, h, sizeof(float) * (size_t)D);
                const float r = 1.0f / sqrtf(dot_fixed(h, h, D) / (float)D + eps);
                for (int64_t d = 0; d < D; d++) o[d] = w[d] * (h[d] * r);
            } else {
                const uint16_t *res = residual ? (const uint16_t *)residual + base : NULL; /* may be residual_out */
                uint16_t *restrict o = (uint16_t *)out + base;
                const uint16_t *restrict w = (const uint16_t *)weight;
                load_row((const uint16_t *)x + base, 2, D, h);
                if (residual)
                    for (int64_t d = 0; d < D; d++) h[d] = round_bf16(h[d] + bf16_to_f32(res[d]));
                if (residual_out) {
                    uint16_t *ro = (uint16_t *)residual_out + base;
                    for (int64_t d = 0; d < D; d++) ro[d] = f32_to_bf16(h[d]);
                }
                const float r = 1.0f / sqrtf(dot_fixed(h, h, D) / (float)D + eps);
                for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(bf16_to_f32(w[d]) * round_bf16(h[d] * r));
            }
        }
        free(h);
    }
    return failed ? -1 : 0;
}

/* Gated activation of a merged [T, 2I] gate/up row (vLLM's SiluAndMul; GeGLU): gate = columns
 * [0, I), up = [I, 2I) of each row of x (row stride ldx); out [T, I]:
 *   out = act(gate) * up, act(gate) rounded to bf16 first in bf16 mode
 *   (unary_fixed_order(gate, op).to(dtype) * up).
 * op 0: SiLU (silu_array, the bits of tpguide_unary op 0); 1: tanh-GELU (tpguide_unary op 1).
 * Returns 0, or -1 for an unknown dtype or op, or out of memory. */
int tpguide_act_and_mul(const void *x, int64_t ldx, int64_t dtype, int64_t T, int64_t I, int64_t op, void *out,
                        int64_t num_threads) {
    if ((dtype != 0 && dtype != 2) || (op != 0 && op != 1)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *g = (float *)malloc(sizeof(float) * (size_t)(2 * I > 0 ? 2 * I : 1));
        if (!g) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!g) continue;
            float *a = g + I;
            const size_t esize = dtype == 0 ? 4 : 2;
            load_row((const char *)x + t * ldx * esize, dtype, I, g);
            if (op == 0)
                silu_array(g, a, 0, I);
            else
                for (int64_t i = 0; i < I; i++) a[i] = unary_scalar(g[i], 1, 0.0f);
            if (dtype == 0) {
                const float *restrict up = (const float *)x + t * ldx + I;
                float *restrict o = (float *)out + t * I;
                for (int64_t i = 0; i < I; i++) o[i] = a[i] * up[i];
            } else {
                const uint16_t *restrict up = (const uint16_t *)x + t * ldx + I;
                uint16_t *restrict o = (uint16_t *)out + t * I;
                for (int64_t i = 0; i < I; i++) o[i] = f32_to_bf16(round_bf16(a[i]) * bf16_to_f32(up[i]));
            }
        }
        free(g);
    }
    return failed ? -1 : 0;
}

/* One head of rotate-half RoPE (RoFormer; HF Llama's q * cos + rotate_half(q) * sin) on the first R
 * elements of a D-wide head, the rest copied: for d < R, half = R / 2,
 *   rot = d < half ? -x[d + half] : x[d - half],  y = x[d] * c[d] + rot * s[d],
 * each product and the sum rounded to bf16 in bf16 mode (torch's bf16 ops); elements d >= R are copied. */
static inline void rotate_head(const void *x, int64_t xi, const void *c, const void *s, int64_t ci, int64_t dtype,
                               int64_t D, int64_t R, void *out, int64_t oi) {
    const int64_t half = R / 2;
    if (dtype == 0) { /* two loops without a select on the address, so the compiler vectorises them */
        const float *restrict xs = (const float *)x + xi, *restrict cs = (const float *)c + ci;
        const float *restrict ss = (const float *)s + ci;
        float *restrict o = (float *)out + oi;
        for (int64_t d = 0; d < half; d++) o[d] = xs[d] * cs[d] + -xs[d + half] * ss[d];
        for (int64_t d = half; d < R; d++) o[d] = xs[d] * cs[d] + xs[d - half] * ss[d];
    } else {
        const uint16_t *restrict xs = (const uint16_t *)x + xi, *restrict cs = (const uint16_t *)c + ci;
        const uint16_t *restrict ss = (const uint16_t *)s + ci;
        uint16_t *restrict o = (uint16_t *)out + oi;
        for (int64_t d = 0; d < half; d++)
            o[d] = f32_to_bf16(round_bf16(bf16_to_f32(xs[d]) * bf16_to_f32(cs[d])) +
                               round_bf16(-bf16_to_f32(xs[d + half]) * bf16_to_f32(ss[d])));
        for (int64_t d = half; d < R; d++)
            o[d] = f32_to_bf16(round_bf16(bf16_to_f32(xs[d]) * bf16_to_f32(cs[d])) +
                               round_bf16(bf16_to_f32(xs[d - half]) * bf16_to_f32(ss[d])));
    }
    const size_t esize = dtype == 0 ? 4 : 2; /* the pass-through part: a bit copy, as torch.cat */
    memcpy((char *)out + (oi + R) * esize, (const char *)x + (xi + R) * esize, (size_t)(D - R) * esize);
}

/* RoPE of q and k in one pass, optionally writing k and v at given rows of a KV cache.
 * q: [T, H, D] at element strides (q_st, q_sh, 1); k, v: [T, Hkv, D] at (k_st, k_sh, 1), (v_st, v_sh, 1)
 * (v may be NULL: not copied); cos, sin: [T, R] of dtype (R even, R <= D); q_out: [T, H, D]
 * contiguous; k_out, v_out: [num_rows, Hkv, D] contiguous, token t's heads at row rows[t]
 * (rows NULL: row t).  Returns 0, or -1 for an unknown dtype, an odd or too large R, or a row
 * outside [0, num_rows). */
int tpguide_rotary(const void *q, int64_t q_st, int64_t q_sh, const void *k, int64_t k_st, int64_t k_sh,
                   const void *v, int64_t v_st, int64_t v_sh, int64_t dtype, int64_t T, int64_t H, int64_t Hkv,
                   int64_t D, int64_t R, const void *cos_t, const void *sin_t, void *q_out, void *k_out,
                   void *v_out, const int64_t *rows, int64_t num_rows, int64_t num_threads) {
    if ((dtype != 0 && dtype != 2) || R % 2 || R > D || R < 0) return -1;
    if (rows)
        for (int64_t t = 0; t < T; t++)
            if (rows[t] < 0 || rows[t] >= num_rows) return -1;
    const size_t esize = dtype == 0 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = rows ? rows[t] : t;
        for (int64_t h = 0; h < H; h++)
            rotate_head(q, t * q_st + h * q_sh, cos_t, sin_t, t * R, dtype, D, R, q_out, (t * H + h) * D);
        for (int64_t h = 0; h < Hkv; h++) {
            rotate_head(k, t * k_st + h * k_sh, cos_t, sin_t, t * R, dtype, D, R, k_out, (row * Hkv + h) * D);
            if (v) /* a bit copy, as the index_put_ it replaces */
                memcpy((char *)v_out + (row * Hkv + h) * D * esize, (const char *)v + (t * v_st + h * v_sh) * esize,
                       (size_t)D * esize);
        }
    }
    return 0;
}

/* ---- bf16 pair kernels: VDPBF16PS (AVX512_BF16) and a plain-C emulation of the SDM's pseudo-code ----
 * Weights in k pairs, the AMX layout: w[U][P][K_pad / 2][NB][2] bf16 (zero past N and past K_unit),
 * K_pad = K_unit rounded up to 2 (to 32 for AMX); x bf16 [M, ldx], unit u at columns
 * [u*K_pad, (u+1)*K_pad), zero-padded by the caller.  Every "+" below is an fp32 operation rounded to
 * nearest even, with bf16 denormal inputs read as zero and denormal results flushed to a zero of
 * their sign (the Intel SDM: "DAZ=FTZ=1, RNE"); an FMA rounds once.  From acc = 0:
 *   VDPBF16PS (instruction 1), pairs p ascending:
 *     acc = fma(x[2p+1], w[2p+1], acc); acc = fma(x[2p], w[2p], acc)
 *   TDPBF16PS (instruction 2), 32-wide k tiles ascending; in a tile two chains from zero over its
 *   16 pairs ascending, e = fma(x[2p], w[2p], e), o = fma(x[2p+1], w[2p+1], o); then
 *     acc = acc + (e + o)
 * Not the fmaf chain of tpguide_linear_units, so these classes' bf16 bits are their own; every
 * element's sequence is fixed, whatever the rows beside it, the columns per call and threads. */

/* bf16 -> fp32 with denormals as (signed) zero: the instructions' "DAZ". */
static inline float bf16_daz(uint16_t h) { return bf16_to_f32((h & 0x7F80u) ? h : (uint16_t)(h & 0x8000u)); }

/* An fp32 result below the smallest normal becomes a zero of its sign: "FTZ". */
static inline float flush_tiny(float v) { return fabsf(v) < FLT_MIN ? copysignf(0.0f, v) : v; }

#define PAIR_VDPBF16PS 1
#define PAIR_TDPBF16PS 2
#define AMX_K_TILE 32 /* bf16 k values per TDPBF16PS */

/* Emulated tile: rows [0, mr) x NB columns of one packed panel, acc from zero, in plain C. */
static void pair_tile_emulated(int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K_pad,
                               int instruction, float acc_out[MR][NB]) {
    float acc[MR][NB], even[MR][NB], odd[MR][NB];
    memset(acc, 0, sizeof(acc));
    const int64_t pairs_per_step = instruction == PAIR_TDPBF16PS ? AMX_K_TILE / 2 : 1;
    for (int64_t p0 = 0; p0 < K_pad / 2; p0 += pairs_per_step) {
        memset(even, 0, sizeof(even));
        memset(odd, 0, sizeof(odd));
        for (int64_t p = p0; p < p0 + pairs_per_step; p++) {
            const uint16_t *wp = w + p * NB * 2;
            for (int r = 0; r < mr; r++) {
                const float x0 = bf16_daz(x[r * ldx + 2 * p]), x1 = bf16_daz(x[r * ldx + 2 * p + 1]);
                for (int j = 0; j < NB; j++) {
                    const float w0 = bf16_daz(wp[2 * j]), w1 = bf16_daz(wp[2 * j + 1]);
                    if (instruction == PAIR_VDPBF16PS) {
                        acc[r][j] = flush_tiny(fmaf(x1, w1, acc[r][j]));
                        acc[r][j] = flush_tiny(fmaf(x0, w0, acc[r][j]));
                    } else {
                        even[r][j] = flush_tiny(fmaf(x0, w0, even[r][j]));
                        odd[r][j] = flush_tiny(fmaf(x1, w1, odd[r][j]));
                    }
                }
            }
        }
        if (instruction == PAIR_TDPBF16PS)
            for (int r = 0; r < mr; r++)
                for (int j = 0; j < NB; j++) acc[r][j] = flush_tiny(acc[r][j] + flush_tiny(even[r][j] + odd[r][j]));
    }
    memcpy(acc_out, acc, sizeof(acc));
}

#if defined(__AVX512BF16__) && defined(USE_AVX512)
#define USE_AVX512_BF16 1
/* VDPBF16PS tile: one zmm lane per output column (16 columns' k pairs per weight register), the rows'
 * accumulators in registers, each row's x pair broadcast; one instruction per pair and 16 columns. */
static inline __attribute__((always_inline)) void pair_store(const int mr, const __m512 a0[MR], const __m512 a1[MR],
                                                             float out[MR][NB]) {
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out[r], a0[r]);
        _mm512_storeu_ps(out[r] + 16, a1[r]);
    }
}
/* FN(mr, ...) with mr a constant 1..8, so each row count gets its own unrolled tile. */
#define PAIR_ROWS_DISPATCH(FN, mr, ...)          \
    switch (mr) {                                \
    case 8: FN(8, __VA_ARGS__); break;           \
    case 7: FN(7, __VA_ARGS__); break;           \
    case 6: FN(6, __VA_ARGS__); break;           \
    case 5: FN(5, __VA_ARGS__); break;           \
    case 4: FN(4, __VA_ARGS__); break;           \
    case 3: FN(3, __VA_ARGS__); break;           \
    case 2: FN(2, __VA_ARGS__); break;           \
    default: FN(1, __VA_ARGS__); break;          \
    }
/* The units of one panel summed in registers (sum_units): unit u's chain from zero over its pairs,
 * then total = acc (u == 0) or total + acc, units ascending: the same fp32 operations as a tile per
 * unit then unit_done, without a trip through memory between units.  w: the panel of unit 0, unit u's
 * at w + u * unit_stride; the prefetch runs on into the next unit's panel.  Its pair step is
 * pair_block_rows' written out again on purpose: through a shared inline helper (the accumulators
 * passed as arrays) GCC kept fewer of its 32 accumulators in registers and o_proj ran 1.4x slower. */
static inline __attribute__((always_inline)) void pair_units_rows(const int mr, const uint16_t *x, int64_t ldx,
                                                                  const uint16_t *w, int64_t unit_stride,
                                                                  int64_t K_pad, int64_t U, float total_out[MR][NB]) {
    __m512 t0[MR], t1[MR];
    const int64_t pairs = K_pad / 2;
    const int64_t dist = pairs < PREFETCH_PAIRS ? pairs : PREFETCH_PAIRS;
    for (int64_t u = 0; u < U; u++) {
        const uint16_t *xu = x + u * K_pad, *wu = w + u * unit_stride;
        const uint16_t *wn = u + 1 < U ? wu + unit_stride : wu + pairs * NB * 2;
        __m512 a0[MR], a1[MR];
        for (int r = 0; r < mr; r++) a0[r] = a1[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t q = p + dist;
            prefetch_bytes((const char *)(q < pairs ? wu + q * NB * 2 : wn + (q - pairs) * NB * 2), NB * 2 * 2);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(wu + p * NB * 2));
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(wu + p * NB * 2 + 32));
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, xu + r * ldx + 2 * p, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);
                a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);
            }
        }
        for (int r = 0; r < mr; r++) {
            t0[r] = u == 0 ? a0[r] : _mm512_add_ps(t0[r], a0[r]);
            t1[r] = u == 0 ? a1[r] : _mm512_add_ps(t1[r], a1[r]);
        }
    }
    pair_store(mr, t0, t1, total_out);
}
static void pair_units_dpbf16(int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t unit_stride,
                              int64_t K_pad, int64_t U, float total_out[MR][NB]) {
    PAIR_ROWS_DISPATCH(pair_units_rows, mr, x, ldx, w, unit_stride, K_pad, U, total_out)
}
/* Pairs [p0, p1) of one panel into acc (rows [0, mr)): from zero (from_zero), or added on to acc
 * (from memory: exact fp32 in and out), so a chain split into k blocks is the unsplit chain's
 * operations in its order.  pf: where the prefetch reads meanwhile, pair p at pf + (p - p0) pairs
 * (the panel's next k block, or further on in the panel), NULL for none. */
static inline __attribute__((always_inline)) void pair_block_rows(const int mr, const uint16_t *x, int64_t ldx,
                                                                  const uint16_t *w, int64_t p0, int64_t p1,
                                                                  const uint16_t *pf, int from_zero,
                                                                  float acc[MR][NB]) {
    __m512 a0[MR], a1[MR];
    for (int r = 0; r < mr; r++) {
        a0[r] = from_zero ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[r]);
        a1[r] = from_zero ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[r] + 16);
    }
    for (int64_t p = p0; p < p1; p++) {
        if (pf) prefetch_bytes((const char *)(pf + (p - p0) * NB * 2), NB * 2 * 2);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w + p * NB * 2));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w + p * NB * 2 + 32));
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            a0[r] = _mm512_dpbf16_ps(a0[r], xv, w0);
            a1[r] = _mm512_dpbf16_ps(a1[r], xv, w1);
        }
    }
    pair_store(mr, a0, a1, acc);
}
static void pair_block(int mr, const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t p0, int64_t p1,
                       const uint16_t *pf, int from_zero, float acc[MR][NB]) {
    PAIR_ROWS_DISPATCH(pair_block_rows, mr, x, ldx, w, p0, p1, pf, from_zero, acc)
}

#define KB_PAIRS 128 /* k pairs per block of the few-row-blocks path: 16 KiB of a panel, kept in L1 */
#define RB_MAX 8     /* the few-row-blocks path: 2 .. RB_MAX row blocks (9 .. 64 rows), units of KB_PAIRS pairs or more */

/* One panel for all R (2 .. RB_MAX) row blocks at once, k in blocks of KB_PAIRS: each block of the
 * panel is read from memory once, for the first row block (prefetching the next block meanwhile), then
 * from L1 for the others, so the weight stream overlaps the arithmetic instead of preceding it (a decode
 * step of 9-64 rows reads each weight once).  Every element's chain is the one-tile path's in its order, its
 * units added as unit_done adds them. */
static void pair_panel_row_blocks(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K_pad,
                                  int64_t U, int64_t P, int64_t N, int64_t p, void *out, int64_t out_dtype,
                                  int64_t sum_units) {
    float acc[RB_MAX][MR][NB], total[RB_MAX][MR][NB];
    const int64_t R = (M + MR - 1) / MR, pairs = K_pad / 2, n0 = p * NB;
    const int nb = (int)(N - n0 < NB ? N - n0 : NB);
    for (int64_t u = 0; u < U; u++) {
        const uint16_t *wu = w + (u * P + p) * K_pad * NB;
        memset(acc, 0, sizeof(acc[0]) * R);
        for (int64_t q0 = 0; q0 < pairs; q0 += KB_PAIRS) {
            const int64_t q1 = q0 + KB_PAIRS < pairs ? q0 + KB_PAIRS : pairs;
            const uint16_t *next = q1 < pairs ? wu + q1 * NB * 2 : (u + 1 < U ? wu + P * K_pad * NB : NULL);
            for (int64_t rb = 0; rb < R; rb++) {
                const int64_t m0 = rb * MR;
                const int mr = (int)(M - m0 < MR ? M - m0 : MR);
                pair_block(mr, x + m0 * ldx + u * K_pad, ldx, wu, q0, q1, rb == 0 ? next : NULL, 0, acc[rb]);
            }
        }
        for (int64_t rb = 0; rb < R; rb++) {
            const int64_t m0 = rb * MR;
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            unit_done(acc[rb], total[rb], u, sum_units, sum_units ? (float *)out : (float *)out + u * M * N, N, m0,
                      n0, mr, nb);
        }
    }
    if (sum_units)
        for (int64_t rb = 0; rb < R; rb++) {
            const int64_t m0 = rb * MR;
            store_tile(total[rb], out, out_dtype, N, m0, n0, (int)(M - m0 < MR ? M - m0 : MR), nb);
        }
}
#endif

/* 1 if this build has the VDPBF16PS tile (compiled with -mavx512bf16), else 0. */
int tpguide_has_dpbf16(void) {
#if defined(USE_AVX512_BF16)
    return 1;
#else
    return 0;
#endif
}

/* The bf16 pair linear (layout above); out / sum_units / out_dtype as tpguide_linear_units.
 * emulate != 0: the plain-C tile (any CPU) of `instruction` (1: VDPBF16PS, 2: TDPBF16PS);
 * emulate == 0: the VDPBF16PS tile (instruction must be 1).  Returns 0, or -1 for an odd K_pad
 * (not a multiple of 32 for TDPBF16PS), a bad out_dtype or instruction, or emulate == 0 in a build
 * without VDPBF16PS or with instruction 2. */
int tpguide_linear_units_pairs(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K_pad,
                               int64_t U, int64_t N, void *out, int64_t out_dtype, int64_t sum_units,
                               int64_t instruction, int64_t emulate, int64_t num_threads) {
    if (K_pad % 2 || (out_dtype != 0 && (out_dtype != 2 || !sum_units))) return -1;
    if ((instruction != PAIR_VDPBF16PS && instruction != PAIR_TDPBF16PS) ||
        (instruction == PAIR_TDPBF16PS && K_pad % AMX_K_TILE))
        return -1;
    if (!emulate && (!tpguide_has_dpbf16() || instruction != PAIR_VDPBF16PS)) return -1;
    const int64_t P = (N + NB - 1) / NB;
    const int64_t R = (M + MR - 1) / MR;
#if defined(USE_AVX512_BF16)
    if (!emulate && R >= 2 && R <= RB_MAX && K_pad / 2 >= KB_PAIRS) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t p = 0; p < P; p++)
            pair_panel_row_blocks(x, M, ldx, w, K_pad, U, P, N, p, out, out_dtype, sum_units);
        return 0;
    }
#endif
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < P; p++) {
        for (int64_t rb = 0; rb < R; rb++) {
            const int64_t m0 = rb * MR;
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            const int64_t n0 = p * NB;
            const int nb = (int)(N - n0 < NB ? N - n0 : NB);
            float acc[MR][NB];
            float total[MR][NB];
#if defined(USE_AVX512_BF16)
            if (!emulate && sum_units) {
                pair_units_dpbf16(mr, x + m0 * ldx, ldx, w + p * K_pad * NB, P * K_pad * NB, K_pad, U, total);
                store_tile(total, out, out_dtype, N, m0, n0, mr, nb);
                continue;
            }
#endif
            for (int64_t u = 0; u < U; u++) {
                const uint16_t *xu = x + m0 * ldx + u * K_pad;
                const uint16_t *wu = w + (u * P + p) * K_pad * NB;
#if defined(USE_AVX512_BF16)
                if (!emulate) /* one unit's chain from zero, the prefetch PREFETCH_PAIRS ahead in its panel */
                    pair_block(mr, xu, ldx, wu, 0, K_pad / 2, wu + PREFETCH_PAIRS * NB * 2, 1, acc);
                else
#endif
                    pair_tile_emulated(mr, xu, ldx, wu, K_pad, (int)instruction, acc);
                unit_done(acc, total, u, sum_units, sum_units ? (float *)out : (float *)out + u * M * N, N, m0, n0,
                          mr, nb);
            }
            if (sum_units) store_tile(total, out, out_dtype, N, m0, n0, mr, nb);
        }
    }
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX bf16 linear.  Each output element is a fixed sequence of TDPBF16PS steps, one per 32-wide k
 * tile, k tiles ascending; inside a step the hardware's own fixed order over the 16 k pairs.  A
 * tile's rows are independent, so a row's value does not depend on the rows beside it, on the
 * columns per call or on the thread count (the order differs from the fmaf chain of the tiles
 * above: bf16 bits on an AMX CPU are not those of its AVX2 build).
 * x: bf16 [M, ldx], unit u at columns [u*K_pad, (u+1)*K_pad), K_pad % 32 == 0 (zero-padded by the
 * caller); w: [U][P][K_pad / 2][NB][2] bf16 (VNNI pairs), zero past N and past the unit's width.
 * out / sum_units as tpguide_linear_units. */
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Ask the kernel for the AMX tile state (once per process); 0 on success. */
int tpguide_amx_init(void) {
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
}

/* Tiles 0, 1: C rows [0, top) x columns 0-15 / 16-31; 2: A rows [0, top); 3, 4: B.  With bottom > 0
 * (a 32-row block) also 5, 6: C rows [16, 16 + bottom); 7: A rows [16, 16 + bottom). */
static void amx_configure(int top, int bottom) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 2; t++) { cfg.rows[t] = (uint8_t)top; cfg.colsb[t] = 64; }     /* C: rows x 16 fp32 */
    cfg.rows[2] = (uint8_t)top; cfg.colsb[2] = 64;                                      /* A: rows x 32 bf16 */
    for (int t = 3; t < 5; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }                /* B: 16 pairs x 16 cols */
    if (bottom > 0) {
        for (int t = 5; t < 8; t++) { cfg.rows[t] = (uint8_t)bottom; cfg.colsb[t] = 64; }
    }
    _tile_loadconfig(&cfg);
}

/* One unit of a row block: C tiles from zero, one TDPBF16PS per 32-wide k tile in ascending order
 * (each C element's order is the same whether the block has 16 or 32 rows: rows are independent). */
static inline __attribute__((always_inline)) void amx_unit(const uint16_t *xu, int64_t ldx, const uint16_t *wu,
                                                           int64_t K_pad, int two, float *c, float *c2,
                                                           int64_t ldc) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(5);
        _tile_zero(6);
    }
    for (int64_t k0 = 0; k0 < K_pad; k0 += 32) {
        const uint16_t *wk = wu + (k0 / 2) * NB * 2; /* 16 pair rows of NB columns */
        _tile_loadd(2, xu + k0, ldx * 2);
        _tile_loadd(3, wk, NB * 4);
        _tile_loadd(4, wk + 32, NB * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
        if (two) {
            _tile_loadd(7, xu + 16 * ldx + k0, ldx * 2);
            _tile_dpbf16ps(5, 7, 3);
            _tile_dpbf16ps(6, 7, 4);
        }
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
    if (two) {
        _tile_stored(5, c2, ldc * 4);
        _tile_stored(6, c2 + 16, ldc * 4);
    }
}

int tpguide_linear_units_amx(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K_pad,
                             int64_t U, int64_t N, void *out, int64_t out_dtype, int64_t sum_units,
                             int64_t num_threads) {
    if (K_pad % 32 || (out_dtype != 0 && (out_dtype != 2 || !sum_units))) return -1;
    const int64_t P = (N + NB - 1) / NB;
    const int64_t R = (M + 31) / 32; /* blocks of 32 rows (two A tiles share each B tile) */
#pragma omp parallel num_threads(num_threads)
    {
        int configured = -1;
#pragma omp for collapse(2) schedule(static)
        for (int64_t p = 0; p < P; p++) {
            for (int64_t rb = 0; rb < R; rb++) {
                const int64_t m0 = rb * 32;
                const int rows = (int)(M - m0 < 32 ? M - m0 : 32);
                const int top = rows < 16 ? rows : 16, bottom = rows - top;
                const int64_t n0 = p * NB;
                const int nb = (int)(N - n0 < NB ? N - n0 : NB);
                if (configured != rows) { amx_configure(top, bottom); configured = rows; }
                float acc[16][NB], total[16][NB], acc2[16][NB], total2[16][NB];
                if (U == 1 && sum_units && nb == NB && out_dtype == 0) { /* one unit, whole fp32 panel: the tiles are the output */
                    float *c = (float *)out + m0 * N + n0;
                    amx_unit(x + m0 * ldx, ldx, w + p * K_pad * NB, K_pad, bottom > 0, c, c + 16 * N, N);
                    continue;
                }
                for (int64_t u = 0; u < U; u++) {
                    const uint16_t *wu = w + (u * P + p) * K_pad * NB;
                    const uint16_t *xu = x + m0 * ldx + u * K_pad;
                    float *unit_out = sum_units ? (float *)out : (float *)out + u * M * N;
                    if (bottom > 0) {
                        amx_unit(xu, ldx, wu, K_pad, 1, &acc[0][0], &acc2[0][0], NB);
                        unit_done(acc2, total2, u, sum_units, unit_out, N, m0 + 16, n0, bottom, nb);
                    } else {
                        amx_unit(xu, ldx, wu, K_pad, 0, &acc[0][0], &acc2[0][0], NB);
                    }
                    unit_done(acc, total, u, sum_units, unit_out, N, m0, n0, top, nb);
                }
                if (sum_units) {
                    store_tile(total, out, out_dtype, N, m0, n0, top, nb);
                    if (bottom > 0) store_tile(total2, out, out_dtype, N, m0 + 16, n0, bottom, nb);
                }
            }
        }
        if (configured != -1) _tile_release();
    }
    return 0;
}
#endif

/* The decoder stack in one call (its own file, one library). */
#include "decoder_layers_cpu.c"
