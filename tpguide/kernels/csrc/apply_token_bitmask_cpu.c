/*
 * CPU kernel of tpguide.kernels.apply_token_bitmask_inplace (docs/architecture.md §2, §3, §8).
 *
 * Plain C99, no Python or torch headers: compiled on first use by
 * tpguide/kernels/apply_token_bitmask_cpu.py and called through ctypes, which
 * releases the GIL for the duration of the call.
 *
 * Logits are handled as unsigned integers of the element width, so a kept logit
 * (NaN included) is never touched and a disallowed one gets the exact bit
 * pattern of -inf: 0xFF800000 (float32), 0xFC00 (float16), 0xFF80 (bfloat16).
 *
 * Per 32-token word, as in xgrammar's CPU kernel and its Triton kernel's
 * whole-word fast paths:
 *   word == -1 -> skip, the logits are not touched;
 *   word ==  0 -> store 32 x -inf without reading the logits;
 *   otherwise  -> a branch-free select per lane (vectorised by the compiler)
 *                 inside a run of touched words, else one store per disallowed
 *                 token (see DEFINE_ROW_SLICE).
 *
 * Strides are in elements.  The logits' last dimension must be contiguous
 * (the Python side falls back to the torch path otherwise).
 */

#include <stdint.h>

#define BITS_PER_WORD 32

/* dtype codes shared with apply_token_bitmask_cpu.py */
#define DTYPE_FLOAT32 0
#define DTYPE_FLOAT16 1
#define DTYPE_BFLOAT16 2

#define NINF_FLOAT32 ((uint32_t)0xFF800000u)
#define NINF_FLOAT16 ((uint16_t)0xFC00u)
#define NINF_BFLOAT16 ((uint16_t)0xFF80u)

/* Bit i of a word, per lane: the form GCC and Clang vectorise (broadcast, and, compare, blend). */
static const uint32_t LANE_BIT_32[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

/* 32 lanes of 32-bit elements: lane i keeps its value when bit i of word is set. */
static inline void mask_word_32(uint32_t *restrict x, uint32_t word, uint32_t ninf) {
    for (int i = 0; i < BITS_PER_WORD; ++i) x[i] = (word & LANE_BIT_32[i]) ? x[i] : ninf;
}

/*
 * KEEP_16[b][i] = 0xFFFF if bit i of byte b is set, else 0: 16-bit lanes get
 * their masks by table lookup, one byte of the word per 8 lanes, and the select
 * is plain and/or on arrays (compilers do not reliably vectorise the compare
 * form above for 16-bit lanes).
 */
#define KEEP_LANE(b, i) ((uint16_t)((((b) >> (i)) & 1) ? 0xFFFFu : 0u))
#define KEEP_BYTE(b)                                                                           \
    {KEEP_LANE(b, 0), KEEP_LANE(b, 1), KEEP_LANE(b, 2), KEEP_LANE(b, 3),                       \
     KEEP_LANE(b, 4), KEEP_LANE(b, 5), KEEP_LANE(b, 6), KEEP_LANE(b, 7)}
#define KEEP_4(b) KEEP_BYTE(b), KEEP_BYTE((b) + 1), KEEP_BYTE((b) + 2), KEEP_BYTE((b) + 3)
#define KEEP_16(b) KEEP_4(b), KEEP_4((b) + 4), KEEP_4((b) + 8), KEEP_4((b) + 12)
#define KEEP_64(b) KEEP_16(b), KEEP_16((b) + 16), KEEP_16((b) + 32), KEEP_16((b) + 48)
static const uint16_t KEEP_16[256][8] = {KEEP_64(0), KEEP_64(64), KEEP_64(128), KEEP_64(192)};

/* 32 lanes of 16-bit elements, 8 lanes per byte of the word. */
static inline void mask_word_16(uint16_t *restrict x, uint32_t word, uint16_t ninf) {
    for (int byte = 0; byte < 4; ++byte) {
        const uint16_t *keep = KEEP_16[(word >> (8 * byte)) & 0xFFu];
        uint16_t *restrict y = x + 8 * byte;
        for (int i = 0; i < 8; ++i) y[i] = (uint16_t)((y[i] & keep[i]) | (ninf & (uint16_t)~keep[i]));
    }
}

/*
 * Store -inf into the lanes whose bit is clear, without reading the logits:
 * one store per disallowed token, as xgrammar's CPU kernel does.  Used for a
 * mixed word after an all-ones word (a free-string state), whose logits are
 * likely not in cache: a read there stalls on memory, a store does not.
 */
#if defined(__GNUC__) || defined(__clang__)
#define STORE_DISALLOWED(T)                                                                    \
    static inline void store_disallowed_##T(T *restrict x, uint32_t word, T ninf) {            \
        for (uint32_t zeros = ~word; zeros; zeros &= zeros - 1u) x[__builtin_ctz(zeros)] = ninf; \
    }
#else
#define STORE_DISALLOWED(T)                                                                    \
    static inline void store_disallowed_##T(T *restrict x, uint32_t word, T ninf) {            \
        for (int i = 0; i < BITS_PER_WORD; ++i)                                                \
            if (!((word >> i) & 1u)) x[i] = ninf;                                              \
    }
#endif
STORE_DISALLOWED(uint32_t)
STORE_DISALLOWED(uint16_t)

/*
 * One row of a vocab shard: column j <-> bit j of the word slice; columns past
 * 32 * num_words are disallowed; padding bits past width are never read.
 *
 * A mixed word after a run of STREAM_RUN touched words (their logits stream
 * through the cache, the hardware prefetcher follows) takes the vectorised
 * read-select-write; any other mixed word takes the store-only path.
 */
#define STREAM_RUN 2
#define DEFINE_ROW_SLICE(NAME, T, MASK_WORD)                                                      \
    static void NAME(T *restrict x, const int32_t *restrict words, int64_t word_stride,           \
                     int64_t width, int64_t num_words, T ninf) {                                   \
        int64_t covered = (int64_t)BITS_PER_WORD * num_words < width                              \
                              ? (int64_t)BITS_PER_WORD * num_words : width;                        \
        int64_t full_words = covered / BITS_PER_WORD;                                             \
        int64_t run = 0; /* touched words just before word w */                                  \
        for (int64_t w = 0; w < full_words; ++w) {                                                \
            uint32_t word = (uint32_t)words[w * word_stride];                                     \
            if (word == 0xFFFFFFFFu) {                                                            \
                run = 0;                                                                          \
                continue;                                                                         \
            }                                                                                     \
            T *restrict y = x + BITS_PER_WORD * w;                                                \
            if (word == 0) {                                                                      \
                for (int i = 0; i < BITS_PER_WORD; ++i) y[i] = ninf;                              \
            } else if (run >= STREAM_RUN) {                                                       \
                MASK_WORD(y, word, ninf);                                                         \
            } else {                                                                              \
                store_disallowed_##T(y, word, ninf);                                              \
            }                                                                                     \
            ++run;                                                                                \
        }                                                                                         \
        int64_t rest = covered - BITS_PER_WORD * full_words; /* columns of a partial last word */ \
        if (rest > 0) {                                                                           \
            uint32_t word = (uint32_t)words[full_words * word_stride];                            \
            T *restrict y = x + BITS_PER_WORD * full_words;                                       \
            for (int64_t i = 0; i < rest; ++i)                                                    \
                if (!((word >> i) & 1u)) y[i] = ninf;                                             \
        }                                                                                         \
        for (int64_t j = covered; j < width; ++j) x[j] = ninf;                                    \
    }

DEFINE_ROW_SLICE(row_slice_32, uint32_t, mask_word_32)
DEFINE_ROW_SLICE(row_slice_16, uint16_t, mask_word_16)

/*
 * One row of a draft shard: column j is draft id g = draft_vocab_start_index + j
 * with target id t = g + d2t[j], read from the full bitmask row; t outside
 * [0, 32 * num_words) is disallowed.
 */
#define DEFINE_ROW_D2T(NAME, T)                                                                   \
    static void NAME(T *restrict x, const int32_t *restrict words, int64_t word_stride,           \
                     int64_t width, int64_t num_words, const int32_t *restrict d2t,                \
                     int64_t d2t_stride, int64_t draft_vocab_start_index, T ninf) {               \
        uint64_t num_bits = (uint64_t)BITS_PER_WORD * (uint64_t)num_words;                        \
        for (int64_t j = 0; j < width; ++j) {                                                     \
            int64_t t = draft_vocab_start_index + j + (int64_t)d2t[j * d2t_stride];               \
            if ((uint64_t)t >= num_bits                                                           \
                || !(((uint32_t)words[(t / BITS_PER_WORD) * word_stride] >> (t % BITS_PER_WORD))  \
                     & 1u))                                                                       \
                x[j] = ninf;                                                                      \
        }                                                                                         \
    }

DEFINE_ROW_D2T(row_d2t_32, uint32_t)
DEFINE_ROW_D2T(row_d2t_16, uint16_t)

/*
 * Apply the bitmask to logits[num_rows, width] in place.
 *
 * logits: row stride logits_row_stride elements, last dimension contiguous.
 * bitmask: int32 [num_rows, num_words], strides bitmask_row_stride / bitmask_col_stride.
 * token_mask: int32 [num_rows] (stride token_mask_stride) or NULL; rows with 0 untouched.
 * d2t: int32 [width] (stride d2t_stride) or NULL (vocab shard layout).
 * Returns 0, or -1 for an unknown dtype code.
 */
static int apply_token_bitmask(void *logits, int64_t dtype, int64_t num_rows, int64_t width,
                               int64_t logits_row_stride, const int32_t *bitmask, int64_t num_words,
                               int64_t bitmask_row_stride, int64_t bitmask_col_stride,
                               const int32_t *token_mask, int64_t token_mask_stride,
                               const int32_t *d2t, int64_t d2t_stride,
                               int64_t draft_vocab_start_index) {
    if (dtype != DTYPE_FLOAT32 && dtype != DTYPE_FLOAT16 && dtype != DTYPE_BFLOAT16) return -1;
    for (int64_t r = 0; r < num_rows; ++r) {
        if (token_mask && token_mask[r * token_mask_stride] == 0) continue;
        const int32_t *words = bitmask + r * bitmask_row_stride;
        if (dtype == DTYPE_FLOAT32) {
            uint32_t *x = (uint32_t *)logits + r * logits_row_stride;
            if (d2t)
                row_d2t_32(x, words, bitmask_col_stride, width, num_words, d2t, d2t_stride,
                           draft_vocab_start_index, NINF_FLOAT32);
            else
                row_slice_32(x, words, bitmask_col_stride, width, num_words, NINF_FLOAT32);
        } else {
            uint16_t ninf = dtype == DTYPE_FLOAT16 ? NINF_FLOAT16 : NINF_BFLOAT16;
            uint16_t *x = (uint16_t *)logits + r * logits_row_stride;
            if (d2t)
                row_d2t_16(x, words, bitmask_col_stride, width, num_words, d2t, d2t_stride,
                           draft_vocab_start_index, ninf);
            else
                row_slice_16(x, words, bitmask_col_stride, width, num_words, ninf);
        }
    }
    return 0;
}

/*
 * Entry point: the arguments packed as int64 (pointers as addresses, 0 = NULL)
 * in the order of enum param, so that ctypes converts one argument, not 14
 * (the per-call overhead matters at one row of a free-string mask).
 */
enum param {
    P_LOGITS, P_DTYPE, P_NUM_ROWS, P_WIDTH, P_LOGITS_ROW_STRIDE,
    P_BITMASK, P_NUM_WORDS, P_BITMASK_ROW_STRIDE, P_BITMASK_COL_STRIDE,
    P_TOKEN_MASK, P_TOKEN_MASK_STRIDE, P_D2T, P_D2T_STRIDE, P_DRAFT_VOCAB_START_INDEX,
    NUM_PARAMS
};

int tpguide_apply_token_bitmask_num_params(void) { return NUM_PARAMS; }

int tpguide_apply_token_bitmask(const int64_t *p) {
    return apply_token_bitmask(
        (void *)(intptr_t)p[P_LOGITS], p[P_DTYPE], p[P_NUM_ROWS], p[P_WIDTH], p[P_LOGITS_ROW_STRIDE],
        (const int32_t *)(intptr_t)p[P_BITMASK], p[P_NUM_WORDS], p[P_BITMASK_ROW_STRIDE],
        p[P_BITMASK_COL_STRIDE], (const int32_t *)(intptr_t)p[P_TOKEN_MASK], p[P_TOKEN_MASK_STRIDE],
        (const int32_t *)(intptr_t)p[P_D2T], p[P_D2T_STRIDE], p[P_DRAFT_VOCAB_START_INDEX]);
}
