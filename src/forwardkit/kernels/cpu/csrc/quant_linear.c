/*
 * forwardkit's native linear over block-quantized weights (q8_0, q4_0, q4_1: the GGUF block
 * layouts, 32 weights a block; fp16 scale first, q4_1 then its fp16 minimum).
 *
 *   y[r, j] = sum_k x[r, k] * W[j, k] (+ bias[j])   for r < M, j < N
 *
 * Portable C plus AVX2 intrinsics, compiled per ISA (AVX-512 with VNNI and AMX-INT8, AVX-512
 * with VNNI, AVX-512, AVX2 + FMA + F16C, or the compiler's baseline) by
 * forwardkit.kernels.cpu.native_quant. Built with -ffp-contract=off, so the dequantization
 * (q4_1: d * q + m, two roundings) gives ggml's float32 values bit for bit.
 *
 * Two entry points (activations and results in float32 or bfloat16: argument `io`, below):
 *
 * fk_quant_linear (1..16 rows: decode steps, small batches). Two strategies (argument `mode`):
 *   0 (float)  each weight block is dequantized in registers and multiplied into float32
 *              activations: the products are those of dequantize-then-matmul.
 *   1 (int8)   the activations are quantized per block of 32 to int8 with one float scale
 *              (ggml's q8_0 rounding), each block's dot product is an integer sum of int8
 *              products, scaled by d_w * d_x (what llama.cpp's CPU backend does); q4_1 adds
 *              m_w * d_x * sum(q_x) per block.
 *   Activation rows are taken in groups of 4, the remainder one at a time; a weight row (at
 *   most a few KB) stays in L1 while every group passes over it. One activation row with the
 *   int8 strategy (a single sequence's decode, the common case) has its own loop: each thread
 *   splits its rows into FK_R contiguous parts and takes one row of each at a time, so it
 *   reads FK_R long sequential streams (one per part) that the hardware prefetchers follow.
 *
 * fk_quant_linear_tiles (any number of rows: prompts). The activations are quantized to int8
 * once per call (as the int8 strategy above), then each tile of FK_NR = 8 weight rows runs
 * against passes of up to FK_MR activation rows: per 32-weight block the 8 weight rows are
 * unpacked to bytes and transposed in 4-byte groups (lane c of t[s] = bytes 4s..4s+3 of row
 * c), so one integer dot product (VPDPBUSD with AVX-512 VNNI; VPMADDUBSW + VPMADDWD on AVX2)
 * takes 4 bytes of an activation row, broadcast, against all 8 weight rows, its lanes being
 * the 8 outputs, and one conversion and one FMA with the 8 scales d_w * d_x finish a row's
 * block. Signedness: VPDPBUSD multiplies unsigned by signed bytes, so
 *   q4_0 / q4_1  take the nibbles as the unsigned operand (0..15); q4_0's "- 8" is the
 *                accumulator's start value, -8 * sum(q_x) (exact, in integers; the sums are
 *                taken once per call); q4_1's minimum adds m_w * d_x * sum(q_x) per block;
 *   q8_0         (VNNI) takes q_x + 128 (made once per call) as the unsigned operand, the
 *                accumulator starting at -128 * sum(q_w) per weight row (exact); (AVX2)
 *                |q_w| against q_x with q_w's sign (VPMADDUBSW's 16-bit pair sums would
 *                saturate on q_x + 128): |q_w| is taken once per unpacked block and serves
 *                every row of the pass, so a row's 4-byte step is a broadcast, a sign, a pair
 *                multiply, a widening multiply and an add (with |q_x| against q_w signed by
 *                q_x, as before, it also took a broadcast of |q_x|: 6 operations, not 5; the
 *                1B shape's products at 16 rows, 2 threads, Zen 3: 1.05-1.15x faster, the
 *                same bits). VPABSB takes a q_w of -128 to 128, right as the unsigned
 *                operand; q_x stops at -127, so its negation never wraps.
 * With AVX-512 and VNNI a tile is 16 weight rows in 512-bit vectors (two 8-row transposes joined
 * lane-wise): each VPDPBUSD then serves 16 outputs for the same per-row work around it.
 * The 8-lane dot products run as two chains of 4 (integer sums: exact, whatever the order);
 * without VNNI, q4's 8 VPMADDUBSW pair sums of a block add in 16 bits (no overflow: nibbles
 * times |q_x| <= 127) and are widened once.
 * Weight tiles are split over the OpenMP threads; activation rows are taken in chunks whose
 * int8 copy stays in L2 while every weight tile passes over it. The int8 activations are laid
 * out block-major for the tiles (a block's 32 bytes of every row adjacent: see fk_tiles).
 *
 * In the 512-bit tiles a block of 16 weight rows is unpacked by one transpose of the packed
 * bytes (16 rows x 4 dwords: a VPERMD per 4 rows and a 4 x 4 transpose of 128-bit lanes), q4's
 * low and high nibbles split afterwards (element e < 16 is byte e's low nibble, e + 16 its high
 * one), instead of two 8 x 8 transposes of the unpacked bytes: 16 shuffles a block, not 64
 * (the 1B shape's qkv, gate_up and down products with 2 threads on an AVX-512 Xeon: 2.75 ->
 * 2.0-2.2 ms at 8 rows, 4.2 -> 3.6-3.75 at 16; the same bits).
 * The amx build runs the tiles of 24 rows and more on the tile unit (the AMX section below);
 * its outputs are the 512-bit tiles' bit for bit.
 *
 * fk_quant_linear_q8 / fk_quant_linear_tiles_q8: the same two kernels (the few-row one with the
 * int8 strategy) on activations already quantized by the caller (xq int8 [M, K], xd the
 * per-block scales [M, K / 32], xs d * sum(q) per block [M, K / 32]): a compiled graph
 * computes them inside the kernel that produces the activations (the RMSNorm or SiLU-and-mul
 * before the projection) with the rounding of fk_quantize_row, so the products are the float
 * entry points' bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <omp.h>

#include "fk_bf16.h"
#include "fk_streams.h"

#define FK_QUANT_ABI_VERSION 4
#define FK_QK 32
#define FK_G 4
#define FK_R 4 /* weight rows the one-row int8 kernel takes at a time */
#define FK_MAX_ROWS 16
#define FK_PARALLEL_MIN (1L << 18) /* weight elements (times rows) below which one thread serves */
#define FK_CHUNK_BYTES (256L << 10) /* int8 activations per chunk of rows (tiles) */
#define FK_PF_ROW_BYTES 4096L /* weight rows up to this long: the tiles prefetch the next tile */

enum { FK_Q8_0 = 0, FK_Q4_0 = 1, FK_Q4_1 = 2 };

int fk_quant_abi_version(void) { return FK_QUANT_ABI_VERSION; }
int fk_quant_max_rows(void) { return FK_MAX_ROWS; }

static inline float fk_half(const uint8_t* p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13));
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

static inline int fk_fmt_ok(int fmt) { return fmt == FK_Q8_0 || fmt == FK_Q4_0 || fmt == FK_Q4_1; }
static inline long fk_block_bytes(int fmt) {
    return fmt == FK_Q8_0 ? 2 + FK_QK : fmt == FK_Q4_0 ? 2 + FK_QK / 2 : 4 + FK_QK / 2;
}
/* Offset of a block's quants (after its fp16 scale, and q4_1's fp16 minimum). */
static inline long fk_quants_at(int fmt) { return fmt == FK_Q4_1 ? 4 : 2; }

/* The 32 integer values of a block (q8_0: q; q4_0: nibble - 8; q4_1: nibble), its scale, and
 * its minimum in *m (q4_1; 0 otherwise). Nibbles: byte i holds element i low, i + 16 high. */
static inline float fk_block_ints(const uint8_t* blk, int fmt, int8_t* q, float* m) {
    *m = 0.0f;
    if (fmt == FK_Q8_0) {
        memcpy(q, blk + 2, FK_QK);
        return fk_half(blk);
    }
    const uint8_t* qs = blk + fk_quants_at(fmt);
    const int off = fmt == FK_Q4_0 ? 8 : 0;
    for (int i = 0; i < FK_QK / 2; i++) {
        q[i] = (int8_t)((qs[i] & 0x0F) - off);
        q[i + FK_QK / 2] = (int8_t)((qs[i] >> 4) - off);
    }
    if (fmt == FK_Q4_1) *m = fk_half(blk + 2);
    return fk_half(blk);
}

#define FK_INLINE static inline __attribute__((always_inline))
#define FK_ALIGN32 __attribute__((aligned(32)))

/* ------------------------------------------------------------------ activations to int8 */
#if defined(__AVX2__)
static inline float fk_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* C roundf (halves away from zero) of every lane, exactly: truncate, then step away from zero
 * where the dropped fraction is at least one half. */
static inline __m256 fk_roundf(__m256 t) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 frac = _mm256_andnot_ps(sign, _mm256_sub_ps(t, r));
    __m256 step = _mm256_or_ps(_mm256_and_ps(t, sign), _mm256_set1_ps(1.0f));
    return _mm256_add_ps(r, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), step));
}
#endif

/* ggml's q8_0 rounding of one activation row's blocks: d = max|x| / 127, q = roundf(x * (1 / d))
 * (float32, as the scalar C gives it); xs (when not NULL) gets d * sum(q) per block. */
static void fk_quantize_row(const float* v, long K, int8_t* xq, float* xd, float* xs) {
    long nb = K / FK_QK;
    for (long b = 0; b < nb; b++) {
        const float* x = v + b * FK_QK;
#if defined(__AVX2__)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
        __m256 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
        float amax = fk_hmax(a);
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256 idv = _mm256_set1_ps(id);
        __m256i q0 = _mm256_cvttps_epi32(fk_roundf(_mm256_mul_ps(x0, idv)));
        __m256i q1 = _mm256_cvttps_epi32(fk_roundf(_mm256_mul_ps(x1, idv)));
        __m256i q2 = _mm256_cvttps_epi32(fk_roundf(_mm256_mul_ps(x2, idv)));
        __m256i q3 = _mm256_cvttps_epi32(fk_roundf(_mm256_mul_ps(x3, idv)));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(xq + b * FK_QK), p);
        if (xs) {
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
            xs[b] = d * (float)_mm_cvtsi128_si32(h);
        }
#else
        float amax = 0.0f;
        for (int i = 0; i < FK_QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < FK_QK; i++) {
            int8_t q = (int8_t)roundf(x[i] * id);
            xq[b * FK_QK + i] = q;
            sum += q;
        }
        if (xs) xs[b] = d * (float)sum;
#endif
        xd[b] = d;
    }
}

static void fk_quantize_rows(const float* x, long rows, long K, int8_t* xq, float* xd, float* xs) {
    long nb = K / FK_QK;
#pragma omp parallel for schedule(static) if (rows * K >= FK_PARALLEL_MIN)
    for (long r = 0; r < rows; r++)
        fk_quantize_row(x + r * K, K, xq + r * K, xd + r * nb, xs ? xs + r * nb : NULL);
}

/* ------------------------------------------------------------------ few rows (1..16) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define FK_VNNI 1
#endif

#if defined(__AVX2__)
/* 32 int8 weights of a block in one register: q8_0 signed, q4_0 nibble - 8, q4_1 nibble. */
static inline __m256i fk_block_vec(const uint8_t* blk, int fmt) {
    if (fmt == FK_Q8_0) return _mm256_loadu_si256((const __m256i*)(blk + 2));
    __m128i packed = _mm_loadu_si128((const __m128i*)(blk + fk_quants_at(fmt)));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    __m256i nib = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
    return fmt == FK_Q4_0 ? _mm256_sub_epi8(nib, _mm256_set1_epi8(8)) : nib;
}

static inline float fk_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sum of the 32 int8 products of w and x, as 8 int32 lanes: |w| (VPABSB: -128 becomes 128,
 * right as the unsigned operand) against x with w's sign (x's quants stop at -127, so no
 * negation wraps; moving x's sign onto w instead would turn a q_w of -128 into -128 again). */
static inline __m256i fk_dot_i8(__m256i w, __m256i x) {
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* One weight row against G (1 or FK_G, a constant after inlining) activation rows, float:
 * each block's 32 weights widened to 4 x 8 floats, d * q (+ m), multiplied into x. */
FK_INLINE void fk_row_float(const float* x, long K, const uint8_t* wrow, int fmt, const int G,
                            float* sums) {
    __m256 acc[FK_G];
    for (int r = 0; r < G; r++) acc[r] = _mm256_setzero_ps();
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
    for (long b = 0; b < nb; b++) {
        const uint8_t* blk = wrow + b * bb;
        __m256i q = fk_block_vec(blk, fmt);
        __m256 d = _mm256_set1_ps(fk_half(blk));
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        __m256 w[4];
        w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
        w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
        w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
        w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
        if (fmt == FK_Q4_1) {
            __m256 m = _mm256_set1_ps(fk_half(blk + 2));
            for (int v = 0; v < 4; v++) w[v] = _mm256_add_ps(w[v], m);
        }
        for (int r = 0; r < G; r++) {
            const float* xr = x + r * K + b * FK_QK;
            for (int v = 0; v < 4; v++) acc[r] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xr + 8 * v), acc[r]);
        }
    }
    for (int r = 0; r < G; r++) sums[r] = fk_hsum(acc[r]);
}

/* One weight row against G int8 activation rows (xq, scales xd, xs = d * sum(q)), int8. */
FK_INLINE void fk_row_int8(const int8_t* xq, const float* xd, const float* xs, long K,
                           const uint8_t* wrow, int fmt, const int G, float* sums) {
    __m256 acc[FK_G];
    float macc[FK_G];
    for (int r = 0; r < G; r++) {
        acc[r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
    for (long b = 0; b < nb; b++) {
        const uint8_t* blk = wrow + b * bb;
        __m256i w = fk_block_vec(blk, fmt);
        float d = fk_half(blk);
        for (int r = 0; r < G; r++) {
            __m256i x = _mm256_loadu_si256((const __m256i*)(xq + r * K + b * FK_QK));
            __m256 dot = _mm256_cvtepi32_ps(fk_dot_i8(w, x));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r * nb + b]), dot, acc[r]);
        }
        if (fmt == FK_Q4_1) {
            float m = fk_half(blk + 2);
            for (int r = 0; r < G; r++) macc[r] += m * xs[r * nb + b];
        }
    }
    for (int r = 0; r < G; r++) sums[r] = fk_hsum(acc[r]) + macc[r];
}

/* The fp16 scales of 4 weight rows' block (at blk, blk + row_bytes, ...) converted together
 * and times d_x (one product each: the same floats as converting and multiplying one at a
 * time), in lanes 0..3 of a 256-bit vector for permutes to spread. */
static inline __m256 fk_scales4(const uint8_t* blk, long row_bytes, float dx) {
    uint16_t h[4];
    for (int r = 0; r < 4; r++) memcpy(&h[r], blk + r * row_bytes, 2);
    uint64_t h4;
    memcpy(&h4, h, 8);
    return _mm256_castps128_ps256(
        _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)h4)), _mm_set1_ps(dx)));
}

/* Block b of R weight rows into acc[0..R). */
FK_INLINE void fk_block1_int8(const int8_t* xq, const float* xd, const float* xs, long b,
                              const uint8_t* w, long row_bytes, int fmt, const int R,
                              __m256* acc, float* macc) {
    long bb = fk_block_bytes(fmt);
    __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * FK_QK));
    float dx = xd[b];
    const uint8_t* blk0 = w + b * bb;
    if (fmt == FK_Q8_0) {
        /* |q_w| against q_x with q_w's sign, as fk_dot_i8 */
        /* 4 rows: their fp16 scales converted together and times d_x in one product (the same
         * floats as one at a time), each then spread by one permute instead of a scalar
         * conversion, product and broadcast per row: over the 1B shape's q8_0 projections
         * (1034 MB, 2 threads, AVX-512 Xeon) 23.8-24.0 -> 24.8-25.4 GB/s (AVX2 build),
         * 24.2-24.6 -> 25.0-25.4 (VNNI), two runs; the streams are near the memory's pace */
        const __m256 s4 = R == 4 ? fk_scales4(blk0, row_bytes, dx) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const uint8_t* blk = blk0 + r * row_bytes;
            const __m256i qw = _mm256_loadu_si256((const __m256i*)(blk + 2));
#if defined(FK_VNNI)
            __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(qw),
                                              _mm256_sign_epi8(x, qw));
#else
            __m256i dot = fk_dot_i8(qw, x);
#endif
            const __m256 sc = R == 4 ? _mm256_permutevar8x32_ps(s4, _mm256_set1_epi32(r))
                                     : _mm256_set1_ps(fk_half(blk) * dx);
            acc[r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(dot), acc[r]);
        }
        return;
    }
#if defined(FK_VNNI)
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i start = fmt == FK_Q4_0
        ? _mm256_sub_epi32(_mm256_setzero_si256(),
                           _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(8), x))
        : _mm256_setzero_si256();
#else
    /* the same without VNNI: unsigned nibbles against signed activations by VPMADDUBSW (pair
     * sums at most 2 * 15 * 127, no saturation), q4_0's - 8 as -8 * the activation's sums */
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i start = fmt == FK_Q4_0
        ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), x), _mm256_set1_epi16(-1))
        : _mm256_setzero_si256();
#endif
    for (int r = 0; r < R; r++) {
        const uint8_t* blk = blk0 + r * row_bytes;
        __m128i packed = _mm_loadu_si128((const __m128i*)(blk + fk_quants_at(fmt)));
        __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
#if defined(FK_VNNI)
        __m256i dot = _mm256_dpbusd_epi32(start, nib, x);
#else
        __m256i dot = _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(nib, x), ones));
#endif
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(fk_half(blk) * dx), _mm256_cvtepi32_ps(dot), acc[r]);
        if (fmt == FK_Q4_1) macc[r] += fk_half(blk + 2) * xs[b];
    }
}

/* 4 q4 weight rows (row_bytes apart) against ONE int8 activation row, two rows to a 256-bit
 * vector. A block's 16 packed bytes of rows r and r + 1 go in the two 128-bit lanes; their low
 * nibbles (elements 0..15) meet the activation's elements 0..15 in both lanes and the high
 * nibbles (16..31) its elements 16..31: two VPDPBUSD with VNNI, else two VPMADDUBSW whose
 * 16-bit sums add without overflow (4 * 15 * 127) and widen once; lanes 0..3 hold row r's sums,
 * 4..7 row r + 1's. The 4 rows' fp16 scales are converted together (one VCVTPH2PS), times d_x,
 * and spread to the two vectors' halves; one conversion and one FMA then finish two rows'
 * block. Per block and 4 rows that is about 40 instructions where one row a register took
 * about 52 (the nibble split and the scale's scalar conversion, broadcast and product were per
 * row). q4_0's "- 8" is -8 * the activation's sums per lane, made once per block. Over the 16
 * layers' q4_0 projections of the 1B shape (547 MB), 2 threads on an AVX-512 Xeon: AVX2 build
 * 16.1-17.0 -> 21.4 GB/s, VNNI build 19.2-19.5 -> 22.6. The sums of a row run in another order
 * than fk_row_int8's (4 lanes of 8 products, not 8 of 4). */
FK_INLINE void fk_rows4_q4_pairs(const int8_t* xq, const float* xd, const float* xs, long K,
                                 const uint8_t* w, long row_bytes, int fmt, float* sums) {
    const long nb = K / FK_QK, bb = fk_block_bytes(fmt), qat = fk_quants_at(fmt);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#if !defined(FK_VNNI)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    const __m256i spread01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i spread23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc01 = _mm256_setzero_ps(), acc23 = _mm256_setzero_ps();
    float macc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (long b = 0; b < nb; b++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + b * FK_QK));
        const __m256i xlo = _mm256_permute4x64_epi64(x, 0x44), xhi = _mm256_permute4x64_epi64(x, 0xEE);
        __m256i start = _mm256_setzero_si256();
        if (fmt == FK_Q4_0) { /* -8 * the 8 activations of each lane */
#if defined(FK_VNNI)
            const __m256i eight = _mm256_set1_epi8(8);
            start = _mm256_sub_epi32(start, _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, eight, xlo),
                                                                eight, xhi));
#else
            const __m256i one8 = _mm256_set1_epi8(1);
            start = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(one8, xlo),
                                                       _mm256_maddubs_epi16(one8, xhi)),
                                      _mm256_set1_epi16(-8));
#endif
        }
        const uint8_t* blk = w + b * bb;
        const __m256 s = fk_scales4(blk, row_bytes, xd[b]);
        __m256i dots[2];
        for (int p = 0; p < 2; p++) {
            const uint8_t* q0 = blk + 2 * p * row_bytes + qat;
            const __m256i v = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)q0)),
                _mm_loadu_si128((const __m128i*)(q0 + row_bytes)), 1);
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#if defined(FK_VNNI)
            dots[p] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, lo, xlo), hi, xhi);
#else
            const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
            dots[p] = _mm256_add_epi32(_mm256_madd_epi16(s16, ones), start);
#endif
        }
        acc01 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[0]), _mm256_permutevar8x32_ps(s, spread01), acc01);
        acc23 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[1]), _mm256_permutevar8x32_ps(s, spread23), acc23);
        if (fmt == FK_Q4_1)
            for (int r = 0; r < 4; r++) macc[r] += fk_half(blk + r * row_bytes + 2) * xs[b];
    }
    float a[16];
    _mm256_storeu_ps(a, acc01);
    _mm256_storeu_ps(a + 8, acc23);
    for (int r = 0; r < 4; r++) {
        const float* l = a + 4 * r;
        sums[r] = ((l[0] + l[1]) + (l[2] + l[3])) + macc[r];
    }
}

/* R (1..FK_R, a constant after inlining) weight rows, row_bytes apart, against ONE int8
 * activation row (decode of one sequence): R independent accumulators, so no chain of FMAs
 * waits on another, and the activation block is loaded once for all R. The caller passes rows
 * far apart (one from each of R parts of a thread's range), so each is the continuation of a
 * long sequential stream. For q8_0 (and a single row) each row's blocks are summed in the
 * order fk_row_int8 sums them and every integer product is exact, so the results are
 * fk_row_int8's bit for bit; 4 q4 rows take fk_rows4_q4_pairs. With VNNI, q4 nibbles go in
 * unsigned against the signed activations (q4_0's - 8 as -8 * the activation sums of each
 * lane, made once per block) and q8_0 as |q_x| against q_w with q_x's sign: one VPDPBUSD
 * instead of two. */
FK_INLINE void fk_rows1_int8(const int8_t* xq, const float* xd, const float* xs, long K,
                             const uint8_t* w, long row_bytes, int fmt, const int R, float* sums) {
    if (R == 4 && fmt != FK_Q8_0) {
        fk_rows4_q4_pairs(xq, xd, xs, K, w, row_bytes, fmt, sums);
        return;
    }
    __m256 acc[FK_R];
    float macc[FK_R];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    for (long b = 0; b < K / FK_QK; b++) fk_block1_int8(xq, xd, xs, b, w, row_bytes, fmt, R, acc, macc);
    for (int r = 0; r < R; r++) sums[r] = fk_hsum(acc[r]) + macc[r];
}
#else
FK_INLINE void fk_row_float(const float* x, long K, const uint8_t* wrow, int fmt, const int G,
                            float* sums) {
    float acc[FK_G][FK_QK];
    memset(acc, 0, sizeof acc);
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
    for (long b = 0; b < nb; b++) {
        int8_t q[FK_QK];
        float w[FK_QK], m;
        float d = fk_block_ints(wrow + b * bb, fmt, q, &m);
        for (int i = 0; i < FK_QK; i++) w[i] = d * (float)q[i] + m;
        for (int r = 0; r < G; r++) {
            const float* xr = x + r * K + b * FK_QK;
            for (int i = 0; i < FK_QK; i++) acc[r][i] += w[i] * xr[i];
        }
    }
    for (int r = 0; r < G; r++) {
        float s = 0.0f;
        for (int i = 0; i < FK_QK; i++) s += acc[r][i];
        sums[r] = s;
    }
}

FK_INLINE void fk_row_int8(const int8_t* xq, const float* xd, const float* xs, long K,
                           const uint8_t* wrow, int fmt, const int G, float* sums) {
    float acc[FK_G] = {0.0f, 0.0f, 0.0f, 0.0f};
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
    for (long b = 0; b < nb; b++) {
        int8_t q[FK_QK];
        float m;
        float d = fk_block_ints(wrow + b * bb, fmt, q, &m);
        for (int r = 0; r < G; r++) {
            const int8_t* xr = xq + r * K + b * FK_QK;
            int32_t s = 0;
            for (int i = 0; i < FK_QK; i++) s += (int32_t)q[i] * (int32_t)xr[i];
            acc[r] += (d * xd[r * nb + b]) * (float)s + m * xs[r * nb + b];
        }
    }
    for (int r = 0; r < G; r++) sums[r] = acc[r];
}

FK_INLINE void fk_rows1_int8(const int8_t* xq, const float* xd, const float* xs, long K,
                             const uint8_t* w, long row_bytes, int fmt, const int R, float* sums) {
    for (int r = 0; r < R; r++) fk_row_int8(xq, xd, xs, K, w + r * row_bytes, fmt, 1, sums + r);
}
#endif

/* Rows [r0, r0 + G) of y for weight row j. */
FK_INLINE void fk_rows(const float* x, const int8_t* xq, const float* xd, const float* xs,
                       const uint8_t* wrow, float add, float* y, long r0, long N, long K, long j,
                       int fmt, int mode, const int G) {
    float sums[FK_G];
    long nb = K / FK_QK;
    if (mode == 0)
        fk_row_float(x + r0 * K, K, wrow, fmt, G, sums);
    else
        fk_row_int8(xq + r0 * K, xd + r0 * nb, xs + r0 * nb, K, wrow, fmt, G, sums);
    for (int r = 0; r < G; r++) y[(r0 + r) * N + j] = sums[r] + add;
}

static void fk_few_rows(const float* x, const int8_t* xq, const float* xd, const float* xs,
                        const uint8_t* w, const float* bias, float* y, long M, long N, long K,
                        int fmt, int mode) {
    long full = M / FK_G * FK_G, row_bytes = K / FK_QK * fk_block_bytes(fmt);
    if (M == 1 && mode == 1) { /* one sequence's decode */
        /* FK_R long sequential streams a thread (fk_streams.h). 6 layers of the 1B shape, 2
         * threads, interleaved: q4_0 31.9 -> 35.0 GB/s (VNNI), 24.9 -> 27.1 (AVX2) against FK_R
         * adjacent rows with the next FK_R prefetched; q8_0 42-50 -> 54-56 against one row at a
         * time. */
        fk_share sh;
#pragma omp parallel if (N * K >= FK_PARALLEL_MIN)
        {
            const fk_parts q = fk_streams_begin(&sh, N, FK_R);
            float sums[FK_R];
            FK_SHARED_STEPS(&sh, N, FK_R, 8, r0, per) {
                fk_rows1_int8(xq, xd, xs, K, w + r0 * row_bytes, per * row_bytes, fmt, FK_R, sums);
                for (long r = 0; r < FK_R; r++) {
                    const long j = r0 + r * per;
                    y[j] = sums[r] + (bias ? bias[j] : 0.0f);
                }
            }
            for (long j = q.lo + FK_R * q.per; j < q.hi; j++) { /* the part's last rows */
                fk_rows1_int8(xq, xd, xs, K, w + j * row_bytes, row_bytes, fmt, 1, sums);
                y[j] = sums[0] + (bias ? bias[j] : 0.0f);
            }
        }
        return;
    }
    fk_share sh;
#pragma omp parallel if (N * K >= FK_PARALLEL_MIN)
    {
        fk_share_begin(&sh, N);
        FK_SHARED_FOR(&sh, j, 8) {
            const uint8_t* wrow = w + j * row_bytes;
            float add = bias ? bias[j] : 0.0f;
            for (long r0 = 0; r0 < full; r0 += FK_G)
                fk_rows(x, xq, xd, xs, wrow, add, y, r0, N, K, j, fmt, mode, FK_G);
            for (long r0 = full; r0 < M; r0++)
                fk_rows(x, xq, xd, xs, wrow, add, y, r0, N, K, j, fmt, mode, 1);
        }
    }
}

/* fk_quant_linear on float32 x and y (below, with the bf16 I/O). */
static int fk_linear_f32(const float* x, const uint8_t* w, const float* bias, float* y, long M,
                         long N, long K, int fmt, int mode) {
    if (M < 1 || M > FK_MAX_ROWS || N < 1 || K < FK_QK || K % FK_QK || !fk_fmt_ok(fmt) ||
        (mode != 0 && mode != 1))
        return -1;
    long nb = K / FK_QK;
    int8_t* xq = NULL;
    float* xd = NULL;
    if (mode == 1) {
        xq = (int8_t*)malloc((size_t)(M * K));
        xd = (float*)malloc(sizeof(float) * (size_t)(2 * M * nb));
        if (!xq || !xd) {
            free(xq);
            free(xd);
            return -1;
        }
        fk_quantize_rows(x, M, K, xq, xd, xd + M * nb);
    }
    fk_few_rows(x, xq, xd, xd ? xd + M * nb : NULL, w, bias, y, M, N, K, fmt, mode);
    free(xq);
    free(xd);
    return 0;
}

/* The int8 strategy on quantized activations (see the top of the file). */
int fk_quant_linear_q8(const int8_t* xq, const float* xd, const float* xs, const uint8_t* w,
                       const float* bias, float* y, long M, long N, long K, int fmt) {
    if (M < 1 || M > FK_MAX_ROWS || N < 1 || K < FK_QK || K % FK_QK || !fk_fmt_ok(fmt)) return -1;
    fk_few_rows(NULL, xq, xd, xs, w, bias, y, M, N, K, fmt, 1);
    return 0;
}

/* ------------------------------------------------------------------ tiles (any rows) */
#define FK_MR 64 /* activation rows one unpacked weight block serves (accumulators in L1) */
#if defined(FK_VNNI) && defined(__AVX512F__)
#define FK_WIDE 1 /* 512-bit tiles */
#define FK_NR 16  /* the 16 lanes of a 512-bit float vector: one weight row each */
#else
#define FK_NR 8 /* the 8 lanes of a 256-bit float vector: one weight row each */
#endif
#if defined(__AVX2__)
/* The 8 x 8 transpose of 32-bit elements: t[s] lane c = u[c] lane s. */
FK_INLINE void fk_transpose8(const __m256i u[8], __m256i t[8]) {
    __m256i a0 = _mm256_unpacklo_epi32(u[0], u[1]), a1 = _mm256_unpackhi_epi32(u[0], u[1]);
    __m256i a2 = _mm256_unpacklo_epi32(u[2], u[3]), a3 = _mm256_unpackhi_epi32(u[2], u[3]);
    __m256i a4 = _mm256_unpacklo_epi32(u[4], u[5]), a5 = _mm256_unpackhi_epi32(u[4], u[5]);
    __m256i a6 = _mm256_unpacklo_epi32(u[6], u[7]), a7 = _mm256_unpackhi_epi32(u[6], u[7]);
    __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
    __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
    __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
    __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
    t[0] = _mm256_permute2x128_si256(b0, b4, 0x20);
    t[1] = _mm256_permute2x128_si256(b1, b5, 0x20);
    t[2] = _mm256_permute2x128_si256(b2, b6, 0x20);
    t[3] = _mm256_permute2x128_si256(b3, b7, 0x20);
    t[4] = _mm256_permute2x128_si256(b0, b4, 0x31);
    t[5] = _mm256_permute2x128_si256(b1, b5, 0x31);
    t[6] = _mm256_permute2x128_si256(b2, b6, 0x31);
    t[7] = _mm256_permute2x128_si256(b3, b7, 0x31);
}

static inline int32_t fk_load4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Block b of a tile's FK_NR weight rows: its 32 weights of each row as bytes (u; q4 nibbles
 * 0..15 in element order), the fp16 scales (halves) and q4_1's fp16 minimums (mins). */
FK_INLINE void fk_unpack_tile(const uint8_t* const* wr, long b, long bb, long qat, int fmt,
                              __m256i* u, uint16_t* halves, uint16_t* mins) {
    for (int j = 0; j < FK_NR; j++) {
        const uint8_t* blk = wr[j] + b * bb;
        memcpy(&halves[j], blk, 2);
        if (fmt == FK_Q8_0) {
            u[j] = _mm256_loadu_si256((const __m256i*)(blk + 2));
        } else {
            if (fmt == FK_Q4_1) memcpy(&mins[j], blk + 2, 2);
            __m128i packed = _mm_loadu_si128((const __m128i*)(blk + qat));
            u[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                                    _mm256_set1_epi8(0x0F));
        }
    }
}

#if defined(FK_WIDE)
/* 16 rows of 4 dwords (16 bytes at p[c], c < 16) transposed: lane c of o[s] = dword s of row
 * c. Four rows a 512-bit vector (one per 128-bit lane), one VPERMD each puts dword s of its 4
 * rows in lane s, and a 4 x 4 transpose of the 128-bit lanes gathers lane s of the four. */
FK_INLINE void fk_transpose16x4(const uint8_t* const* p, __m512i o[4]) {
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i t[4];
    for (int k = 0; k < 4; k++) {
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p[4 * k]));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)p[4 * k + 1]), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)p[4 * k + 2]), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)p[4 * k + 3]), 3);
        t[k] = _mm512_permutexvar_epi32(idx, z);
    }
    const __m512i a0 = _mm512_shuffle_i64x2(t[0], t[1], 0x44), a1 = _mm512_shuffle_i64x2(t[0], t[1], 0xEE);
    const __m512i a2 = _mm512_shuffle_i64x2(t[2], t[3], 0x44), a3 = _mm512_shuffle_i64x2(t[2], t[3], 0xEE);
    o[0] = _mm512_shuffle_i64x2(a0, a2, 0x88);
    o[1] = _mm512_shuffle_i64x2(a0, a2, 0xDD);
    o[2] = _mm512_shuffle_i64x2(a1, a3, 0x88);
    o[3] = _mm512_shuffle_i64x2(a1, a3, 0xDD);
}

/* Block b of 16 weight rows (wr[c]) as t[0..7]: lane c of t[s] = bytes 4s..4s+3 of row c's 32
 * weights (q8_0 signed; q4 nibbles 0..15, in element order), its fp16 scales (halves) and q4_1's
 * fp16 minimums (mins). q4: t[s] and t[s + 4] are the low and high nibbles of the transposed
 * packed bytes (element e < 16 is byte e's low nibble, e + 16 its high one). */
FK_INLINE void fk_unpack16(const uint8_t* const* wr, long b, long bb, long qat, int fmt,
                           __m512i t[8], uint16_t* halves, uint16_t* mins) {
    const uint8_t* p[16];
    for (int c = 0; c < 16; c++) {
        const uint8_t* blk = wr[c] + b * bb;
        memcpy(&halves[c], blk, 2);
        if (fmt == FK_Q4_1) memcpy(&mins[c], blk + 2, 2);
        p[c] = blk + qat;
    }
    if (fmt == FK_Q8_0) {
        fk_transpose16x4(p, t);
        for (int c = 0; c < 16; c++) p[c] += 16;
        fk_transpose16x4(p, t + 4);
    } else {
        __m512i o[4];
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        fk_transpose16x4(p, o);
        for (int s8 = 0; s8 < 4; s8++) {
            t[s8] = _mm512_and_si512(o[s8], m4);
            t[s8 + 4] = _mm512_and_si512(_mm512_srli_epi16(o[s8], 4), m4);
        }
    }
}

/* fk_tile below with 512-bit vectors (AVX-512 with VNNI): 16 weight rows a tile, their two
 * 8 x 8 transposes joined lane-wise, so each VPDPBUSD serves 16 outputs and the per-row work
 * around it (the broadcasts, the conversion, the FMA with the scales) is spread over twice as
 * many. Every output is summed in the same order as the 256-bit tile's: the same floats. */
FK_INLINE void fk_tile(const int8_t* xq, const float* xd, const float* xs, const int32_t* xi,
                       const uint8_t* w, const float* bias, float* y, long M, long m0, long mr, long n0,
                       long nr, long N, long K, const int fmt) {
    const long nb = K / FK_QK, bb = fk_block_bytes(fmt), qat = fk_quants_at(fmt);
    const uint8_t* wr[FK_NR];
    __m512 acc[FK_MR];
    for (long i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j < FK_NR; j++) wr[j] = w + (n0 + (j < nr ? j : nr - 1)) * nb * bb;
    for (long b = 0; b < nb; b++) {
        __m512i t[8];
        uint16_t halves[FK_NR], mins[FK_NR];
        fk_unpack16(wr, b, bb, qat, fmt, t, halves, mins);
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)halves));
        const __m512 wm = fmt == FK_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)mins))
                                         : _mm512_setzero_ps();
        __m512i wc = _mm512_setzero_si512(); /* q8_0: -128 * sum(q_w) per weight row */
        if (fmt == FK_Q8_0) {
            for (int s8 = 0; s8 < 8; s8++)
                wc = _mm512_dpbusd_epi32(wc, _mm512_set1_epi8((char)0x80), t[s8]);
            wc = _mm512_sub_epi32(_mm512_setzero_si512(), wc);
        }
        for (long i = 0; i < mr; i++) {
            const long r = m0 + i;
            const int8_t* xb = xq + (b * M + r) * FK_QK;
            __m512i dot, d2 = _mm512_setzero_si512(); /* two chains of 4 (integers: exact) */
            if (fmt == FK_Q8_0) {
                dot = wc; /* xq holds q_x + 128 here (fk_tiles) */
                for (int s8 = 0; s8 < 4; s8++) {
                    dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(fk_load4(xb + 4 * s8)), t[s8]);
                    d2 = _mm512_dpbusd_epi32(d2, _mm512_set1_epi32(fk_load4(xb + 4 * s8 + 16)), t[s8 + 4]);
                }
            } else {
                dot = _mm512_set1_epi32(fmt == FK_Q4_0 ? xi[b * M + r] : 0);
                for (int s8 = 0; s8 < 4; s8++) {
                    dot = _mm512_dpbusd_epi32(dot, t[s8], _mm512_set1_epi32(fk_load4(xb + 4 * s8)));
                    d2 = _mm512_dpbusd_epi32(d2, t[s8 + 4], _mm512_set1_epi32(fk_load4(xb + 4 * s8 + 16)));
                }
            }
            dot = _mm512_add_epi32(dot, d2);
            __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                       _mm512_mul_ps(wd, _mm512_set1_ps(xd[b * M + r])), acc[i]);
            if (fmt == FK_Q4_1) /* + m_w * d_x * sum(q_x) */
                a = _mm512_fmadd_ps(wm, _mm512_set1_ps(xs[b * M + r]), a);
            acc[i] = a;
        }
    }
    for (long i = 0; i < mr; i++) {
        float out[FK_NR];
        _mm512_storeu_ps(out, acc[i]);
        for (int j = 0; j < nr; j++) y[(m0 + i) * N + n0 + j] = out[j] + (bias ? bias[n0 + j] : 0.0f);
    }
}
#else

/* Without VNNI (the AVX2 and plain AVX-512 builds): rows m0..m0 + mr (mr <= FK_MR) of x against
 * weight rows n0.. (nr <= FK_NR = 8); a short
 * weight tile repeats its last row (computed, not stored). Per 32-weight block the tile's 8
 * weight rows are unpacked to bytes and transposed in 4-byte groups, so lane c of t[s] holds
 * bytes 4s..4s+3 of weight row c: each integer dot product then takes 4 bytes of one
 * activation row, broadcast, against all 8 weight rows, and its lanes are the 8 outputs. One
 * conversion and one FMA with the 8 scales d_w * d_x finish a row's block for all 8 weight
 * rows. The unpacked block serves every row of the pass (up to FK_MR), whose accumulators
 * stay in L1. */
FK_INLINE void fk_tile(const int8_t* xq, const float* xd, const float* xs, const int32_t* xi,
                       const uint8_t* w, const float* bias, float* y, long M, long m0, long mr, long n0,
                       long nr, long N, long K, const int fmt) {
    const long nb = K / FK_QK, bb = fk_block_bytes(fmt), qat = fk_quants_at(fmt);
    const uint8_t* wr[FK_NR];
    __m256 acc[FK_MR];
    for (long i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int j = 0; j < FK_NR; j++) wr[j] = w + (n0 + (j < nr ? j : nr - 1)) * nb * bb;
    /* Short weight rows (up to FK_PF_ROW_BYTES): the next tile's 8 rows are fetched a block
     * at a time beside this one's, as they would start cold (8 new streams of 34 lines each
     * for K = 2048 in q8_0, too short for the hardware prefetchers to get ahead of them). Long
     * rows are left to the hardware. */
    const long rb = nb * bb;
    const uint8_t* nx = rb <= FK_PF_ROW_BYTES && n0 + 2 * FK_NR <= N ? w + (n0 + FK_NR) * rb : NULL;
    for (long b = 0; b < nb; b++) {
        __m256i u[FK_NR], t[FK_NR];
        uint16_t halves[FK_NR], mins[FK_NR];
        if (nx)
            for (int j = 0; j < FK_NR; j++) _mm_prefetch((const char*)(nx + j * rb + b * bb), _MM_HINT_T0);
        fk_unpack_tile(wr, b, bb, qat, fmt, u, halves, mins);
        fk_transpose8(u, t);
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)halves));
        const __m256 wm = fmt == FK_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)mins))
                                         : _mm256_setzero_ps();
        /* q8_0: |q_w| (at, the unsigned operand) in registers; q_w (ts, whose signs go onto
         * q_x) stored, the sign step's memory operand: 16 vectors would not fit the registers */
        __m256i at[FK_NR];
        FK_ALIGN32 __m256i ts[FK_NR];
        if (fmt == FK_Q8_0)
            for (int s8 = 0; s8 < 8; s8++) {
                at[s8] = _mm256_abs_epi8(t[s8]);
                _mm256_store_si256(&ts[s8], t[s8]);
            }
        for (long i = 0; i < mr; i++) {
            const long r = m0 + i;
            const int8_t* xb = xq + (b * M + r) * FK_QK;
            __m256i dot;
            if (fmt == FK_Q8_0) { /* |q_w| against q_x with q_w's sign, one pair sum widened at
                                   * a time (two of 128 * 127 would overflow 16 bits) */
                dot = _mm256_setzero_si256();
                for (int s8 = 0; s8 < 8; s8++) {
                    __m256i xv = _mm256_set1_epi32(fk_load4(xb + 4 * s8));
                    __m256i sx = _mm256_sign_epi8(xv, _mm256_load_si256(&ts[s8]));
                    __m256i p = _mm256_maddubs_epi16(at[s8], sx);
                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                }
            } else {
                /* q4_0's "- 8": -8 * sum(q_x), exact (xi: per row and block) */
                dot = _mm256_set1_epi32(fmt == FK_Q4_0 ? xi[b * M + r] : 0);
                /* nibbles (0..15) times int8 (-127..127): the 8 VPMADDUBSW pair sums of a block
                 * add up in 16 bits without overflow (8 * 2 * 15 * 127 = 30480), so they are
                 * widened to 32 bits once, not 8 times */
                __m256i s16 = _mm256_maddubs_epi16(t[0], _mm256_set1_epi32(fk_load4(xb)));
                for (int s8 = 1; s8 < 8; s8++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(
                                                    t[s8], _mm256_set1_epi32(fk_load4(xb + 4 * s8))));
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
            }
            __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                       _mm256_mul_ps(wd, _mm256_set1_ps(xd[b * M + r])), acc[i]);
            if (fmt == FK_Q4_1) /* + m_w * d_x * sum(q_x) */
                a = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[b * M + r]), a);
            acc[i] = a;
        }
    }
    for (long i = 0; i < mr; i++) {
        float out[FK_NR];
        _mm256_storeu_ps(out, acc[i]);
        for (int j = 0; j < nr; j++) y[(m0 + i) * N + n0 + j] = out[j] + (bias ? bias[n0 + j] : 0.0f);
    }
}
#endif /* FK_WIDE */
#else
FK_INLINE void fk_tile(const int8_t* xq, const float* xd, const float* xs, const int32_t* xi,
                       const uint8_t* w, const float* bias, float* y, long M, long m0, long mr, long n0,
                       long nr, long N, long K, const int fmt) {
    const long nb = K / FK_QK, bb = fk_block_bytes(fmt);
    float acc[FK_MR][FK_NR];
    memset(acc, 0, sizeof acc);
    for (long b = 0; b < nb; b++)
        for (int j = 0; j < nr; j++) {
            int8_t q[FK_QK];
            float m;
            float d = fk_block_ints(w + ((n0 + j) * nb + b) * bb, fmt, q, &m);
            for (int i = 0; i < mr; i++) {
                const long r = m0 + i;
                const int8_t* xr = xq + (b * M + r) * FK_QK;
                int32_t s = 0;
                for (int t = 0; t < FK_QK; t++) s += (int32_t)q[t] * (int32_t)xr[t];
                acc[i][j] += (d * xd[b * M + r]) * (float)s + m * xs[b * M + r];
            }
        }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[(m0 + i) * N + n0 + j] = acc[i][j] + (bias ? bias[n0 + j] : 0.0f);
}
#endif

#define FK_TILE_FN(NAME, FMT)                                                                  \
    static void NAME(const int8_t* xq, const float* xd, const float* xs, const int32_t* xi,   \
                     const uint8_t* w, const float* bias, float* y, long M,                     \
                     long m0, long mr, long n0, long nr, long N, long K) {                             \
        fk_tile(xq, xd, xs, xi, w, bias, y, M, m0, mr, n0, nr, N, K, FMT);                   \
    }
FK_TILE_FN(fk_tile_q8_0, FK_Q8_0)
FK_TILE_FN(fk_tile_q4_0, FK_Q4_0)
FK_TILE_FN(fk_tile_q4_1, FK_Q4_1)

int fk_quant_tile_rows(void) { return FK_MR; }
int fk_quant_tile_cols(void) { return FK_NR; }

#if defined(__AMX_INT8__) && defined(FK_WIDE)
/* ------------------------------------------------------------------ AMX int8 tiles */
/* With AMX (the `amx` build) the tiles' integer dot products run on the tile unit: for a
 * 16-row weight tile and a block, the 8 vectors t[0..7] of the 512-bit tile above are exactly
 * an AMX B operand in its 4-byte-group layout (8 rows of 64 bytes: row s, lane c = bytes
 * 4s..4s+3 of weight row c), so each weight tile is unpacked once per call into such a panel
 * (all blocks, 512 bytes each, with its 16 scales as floats) and every 16 activation rows take
 * one TDPBSSD (q8_0, and q4_0 with its nibbles less 8: both signed) or TDPBSUD (q4_1: the
 * nibbles unsigned) per block: 16 x 16 x 32 products. The int32 results are stored and finished
 * as the 512-bit tile does (one conversion, one FMA with d_w * d_x, q4_1's minimum), in the
 * same order: the integer sums are exact, so the outputs are the VNNI tiles' bit for bit.
 * Two result tiles alternate between blocks and four stored copies rotate, so the tile unit
 * works on the next blocks while the vector unit finishes an earlier one. The kernel asks
 * Linux once for the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM)); where that is refused the
 * VNNI tiles serve (and the Python loader declines the amx build). */
#include <sys/syscall.h>
#include <unistd.h>
#define FK_AMX_MIN_ROWS 24 /* fewer rows take the VNNI tiles (as fast at 16 rows, slower below) */
#define FK_AMX_CHUNK_BYTES (1L << 20) /* int8 activations per chunk of rows (L2: 2 MB a core) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fk_tilecfg;

static int fk_amx_state = -1; /* -1 unknown, 0 refused, 1 granted */

static int fk_amx_ok(void) {
    int s = __atomic_load_n(&fk_amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18); asking twice is harmless */
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&fk_amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

/* The row count from which the AMX tiles serve (this build, Linux granted the tile state), or 0. */
int fk_quant_amx(void) { return fk_amx_ok() ? FK_AMX_MIN_ROWS : 0; }

/* tmm0, tmm1: int32 results (16 x 16); tmm2, tmm4: activations (16 rows x 32 bytes); tmm3,
 * tmm5: weights (8 rows x 64 bytes). Even blocks use 0, 2, 3; odd ones 1, 4, 5. */
static void fk_amx_config(void) {
    fk_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = 16;
    c.colsb[0] = c.colsb[1] = 64;
    c.rows[2] = c.rows[4] = 16;
    c.colsb[2] = c.colsb[4] = 32;
    c.rows[3] = c.rows[5] = 8;
    c.colsb[3] = c.colsb[5] = 64;
    _tile_loadconfig(&c);
}

/* Weight rows n0..n0 + nr (nr <= 16; a short tile repeats its last row) unpacked into the
 * panel: per block 512 bytes of B operand (q4_0's nibbles less 8: signed, so its product needs
 * no -8 * sum(q_x) term), 16 scales and (q4_1) 16 minimums as floats. */
static void fk_amx_panel(const uint8_t* w, long n0, long nr, long nb, int fmt, uint8_t* pb,
                         float* pd, float* pm) {
    const long bb = fk_block_bytes(fmt), qat = fk_quants_at(fmt);
    const uint8_t* wr[16];
    for (int j = 0; j < 16; j++) wr[j] = w + (n0 + (j < nr ? j : nr - 1)) * nb * bb;
    for (long b = 0; b < nb; b++) {
        __m512i t[8];
        uint16_t halves[16], mins[16];
        fk_unpack16(wr, b, bb, qat, fmt, t, halves, mins);
        for (int s8 = 0; s8 < 8; s8++) {
            if (fmt == FK_Q4_0) t[s8] = _mm512_sub_epi8(t[s8], _mm512_set1_epi8(8));
            _mm512_storeu_si512((void*)(pb + b * 512 + s8 * 64), t[s8]);
        }
        _mm512_storeu_ps(pd + b * 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)halves)));
        if (fmt == FK_Q4_1)
            _mm512_storeu_ps(pm + b * 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)mins)));
    }
}

/* Block b's int32 results (c: 16 x 16, row i = activation row m0 + i) into acc. */
FK_INLINE void fk_amx_finish(const int32_t* c, __m512* acc, const float* xd, const float* xs,
                             long b, const float* pd, const float* pm, const int fmt) {
    const __m512 wd = _mm512_loadu_ps(pd + b * 16);
    const float* d = xd + b * 16; /* the 16 rows' scales of block b (packed: fk_amx_tiles) */
    for (int i = 0; i < 16; i++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(c + 16 * i)));
        __m512 a = _mm512_fmadd_ps(dot, _mm512_mul_ps(wd, _mm512_set1_ps(d[i])), acc[i]);
        if (fmt == FK_Q4_1)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(pm + b * 16), _mm512_set1_ps(xs[b * 16 + i]), a);
        acc[i] = a;
    }
}

/* Block b's product into result tile C from activation tile A and weight tile B (register
 * numbers are immediates): q8_0 and q4_0 signed by signed, q4_1's nibbles unsigned. */
#define FK_AMX_BLOCK(C, A, B, b)                                  \
    do {                                                          \
        _tile_zero(C);                                            \
        _tile_loadd(A, xa + (b) * 512, 32);                       \
        _tile_loadd(B, pb + (b) * 512, 64);                       \
        if (fmt == FK_Q4_1)                                       \
            _tile_dpbsud(C, A, B);                                \
        else                                                      \
            _tile_dpbssd(C, A, B);                                \
    } while (0)

/* One tile of 16 activation rows (xa: per block 16 rows of 32 bytes; xd, xs: per block the 16
 * rows' scales; packed by fk_amx_tiles) against one panel, into y rows m0..m0 + mr. Block b
 * runs in result tile b % 2 and is stored into cbuf slot b % 4; it is finished (read back)
 * after block b + 2's product is issued, so the loads never wait on a store just made (two
 * slots instead of four measured 57 against 51 cycles a block). */
FK_INLINE void fk_amx_tile(const int8_t* xa, const float* xd, const float* xs, const uint8_t* pb,
                           const float* pd, const float* pm, const float* bias, float* y, long m0,
                           long mr, long n0, long nr, long N, long K, int32_t* cbuf, const int fmt) {
    const long nb = K / FK_QK;
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    long f = 0; /* the next block to finish */
    for (long b = 0; b < nb; b += 2) { /* b even: tile 0; b + 1 odd: tile 1 */
        FK_AMX_BLOCK(0, 2, 3, b);
        if (f + 2 <= b) {
            fk_amx_finish(cbuf + 256 * (f & 3), acc, xd, xs, f, pd, pm, fmt);
            f++;
        }
        _tile_stored(0, cbuf + 256 * (b & 3), 64);
        if (b + 1 < nb) {
            FK_AMX_BLOCK(1, 4, 5, b + 1);
            if (f + 2 <= b + 1) {
                fk_amx_finish(cbuf + 256 * (f & 3), acc, xd, xs, f, pd, pm, fmt);
                f++;
            }
            _tile_stored(1, cbuf + 256 * ((b + 1) & 3), 64);
        }
    }
    for (; f < nb; f++) fk_amx_finish(cbuf + 256 * (f & 3), acc, xd, xs, f, pd, pm, fmt);
    for (long i = 0; i < mr; i++) {
        float out[16];
        _mm512_storeu_ps(out, acc[i]);
        for (int j = 0; j < nr; j++) y[(m0 + i) * N + n0 + j] = out[j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

#define FK_AMX_TILE_FN(NAME, FMT)                                                               \
    static void NAME(const int8_t* xq, const float* xd, const float* xs, const uint8_t* pb,    \
                     const float* pd, const float* pm, const float* bias, float* y, long m0,   \
                     long mr, long n0, long nr, long N, long K, int32_t* cbuf) {               \
        fk_amx_tile(xq, xd, xs, pb, pd, pm, bias, y, m0, mr, n0, nr, N, K, cbuf, FMT);         \
    }
FK_AMX_TILE_FN(fk_amx_tile_q8_0, FK_Q8_0)
FK_AMX_TILE_FN(fk_amx_tile_q4_0, FK_Q4_0)
FK_AMX_TILE_FN(fk_amx_tile_q4_1, FK_Q4_1)

/* fk_tiles on the tile unit (M >= FK_AMX_MIN_ROWS). xq, xd, xs as fk_tiles takes them (q_x
 * signed for every format). Returns 0, or -1 when out of memory (nothing written). */
static int fk_amx_tiles(const int8_t* xq, const float* xd, const float* xs, const uint8_t* w,
                        const float* bias, float* y, long M, long N, long K, int fmt) {
    void (*tile)(const int8_t*, const float*, const float*, const uint8_t*, const float*,
                 const float*, const float*, float*, long, long, long, long, long, long,
                 int32_t*) =
        fmt == FK_Q8_0 ? fk_amx_tile_q8_0 : fmt == FK_Q4_0 ? fk_amx_tile_q4_0 : fk_amx_tile_q4_1;
    const long nb = K / FK_QK, Mp = (M + 15) / 16 * 16;
    /* The activations packed for the tile loads: per tile of 16 rows and block, the 16 rows'
     * 32 bytes together (512 contiguous bytes, where rows K bytes apart would share L1 sets)
     * and their 16 scales; rows past M are zeros. */
    int8_t* xp = (int8_t*)malloc((size_t)(Mp * K));
    float* sp = (float*)malloc(sizeof(float) * (size_t)(2 * Mp * nb));
    if (!xp || !sp) {
        free(xp);
        free(sp);
        return -1;
    }
#pragma omp parallel for schedule(static) if (M * K >= FK_PARALLEL_MIN)
    for (long mt = 0; mt < Mp / 16; mt++)
        for (long b = 0; b < nb; b++) {
            int8_t* dst = xp + (mt * nb + b) * 512;
            float* dd = sp + (mt * nb + b) * 16;
            for (int i = 0; i < 16; i++) {
                const long r = mt * 16 + i;
                if (r < M) {
                    memcpy(dst + i * 32, xq + r * K + b * FK_QK, 32);
                    dd[i] = xd[r * nb + b];
                    dd[Mp * nb + i] = xs[r * nb + b];
                } else {
                    memset(dst + i * 32, 0, 32);
                    dd[i] = dd[Mp * nb + i] = 0.0f;
                }
            }
        }
    long chunk = FK_AMX_CHUNK_BYTES / K / 16 * 16;
    if (chunk < 16) chunk = 16;
    const long ntiles = (N + 15) / 16;
    /* per thread: the panel (512 + 2 * 64 bytes a block) and four stored result tiles */
    const size_t panel_bytes = (size_t)(nb * 640 + 4096);
    int failed = 0;
    fk_share sh;
#pragma omp parallel if (N * K * M >= FK_PARALLEL_MIN)
    {
        uint8_t* pb = (uint8_t*)aligned_alloc(64, panel_bytes);
        if (!pb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float* pd = (float*)(pb + nb * 512);
            float* pm = pd + nb * 16;
            int32_t* cbuf = (int32_t*)(pm + nb * 16);
            fk_amx_config();
            for (long c0 = 0; c0 < Mp; c0 += chunk) {
                const long c1 = c0 + chunk < Mp ? c0 + chunk : Mp;
                fk_share_begin(&sh, ntiles);
                FK_SHARED_FOR(&sh, t, 1) {
                    const long n0 = t * 16, nr = N - n0 < 16 ? N - n0 : 16;
                    fk_amx_panel(w, n0, nr, nb, fmt, pb, pd, pm);
                    for (long m0 = c0; m0 < c1; m0 += 16)
                        tile(xp + m0 * K, sp + m0 * nb, sp + Mp * nb + m0 * nb, pb, pd, pm, bias,
                             y, m0, M - m0 < 16 ? M - m0 : 16, n0, nr, N, K, cbuf);
                }
            }
            _tile_release();
        }
        free(pb);
    }
    free(xp);
    free(sp);
    return failed ? -1 : 0;
}
#else
int fk_quant_amx(void) { return 0; }
#endif

/* Returns 0, or -1 when out of memory (nothing written). */
static int fk_tiles(const int8_t* xq, const float* xd, const float* xs, const uint8_t* w,
                    const float* bias, float* y, long M, long N, long K, int fmt) {
    void (*tile)(const int8_t*, const float*, const float*, const int32_t*, const uint8_t*,
                 const float*, float*, long, long, long, long, long, long, long) =
        fmt == FK_Q8_0 ? fk_tile_q8_0 : fmt == FK_Q4_0 ? fk_tile_q4_0 : fk_tile_q4_1;
#if defined(__AMX_INT8__) && defined(FK_WIDE)
    if (M >= FK_AMX_MIN_ROWS && fk_amx_ok()) return fk_amx_tiles(xq, xd, xs, w, bias, y, M, N, K, fmt);
#endif
    const long nb = K / FK_QK;
    /* The activations block-major: row r's block b (32 bytes; its scale, its d * sum(q)) at
     * index b * M + r, so the rows a tile takes for one block are adjacent. Row-major, those
     * rows lay K bytes apart: with K a multiple of 2 KiB they fell into one or two L1 sets, more
     * lines than the sets hold, and every pass over a block went to L2. The 1B shape's qkv,
     * o, gate_up and down products, 2 threads, medians of 21, the same bits (GOPS, row-major ->
     * block-major): AVX2 q8_0 16 rows 177-195 / 168-190 / 193-196 / 179 -> 192-199 / 190-193 /
     * 214-216 / 205-209, 64 rows 188-200 / 191-199 / 188-196 / 148-156 -> 221-230 / 216-233 /
     * 221-234 / 231-237; AVX2 q4_0 64 rows 280-298 / 280-281 / 293-301 / 234-236 -> 350-356 /
     * 333-342 / 367-395 / 369-390; VNNI q8_0 16 rows 381 / 336 / 449 / 401 -> 433 / 406 / 503 /
     * 467. */
    /* Everything the tiles read is made here in one pass over the blocks: q_x block-major (for
     * q8_0 on VNNI, q_x + 128: VPDPBUSD's unsigned operand), its scales and d * sum(q) terms,
     * and q4_0's -8 * sum(q_x) per row and block (a broadcast load in the tile). */
    int8_t* xqb = (int8_t*)malloc((size_t)(M * K));
    float* xdb = (float*)malloc(sizeof(float) * (size_t)(2 * M * nb));
    int32_t* xi = fmt == FK_Q4_0 ? (int32_t*)malloc(sizeof(int32_t) * (size_t)(M * nb)) : NULL;
    if (!xqb || !xdb || (fmt == FK_Q4_0 && !xi)) {
        free(xqb);
        free(xdb);
        free(xi);
        return -1;
    }
    for (long r = 0; r < M; r++)
        for (long b = 0; b < nb; b++) {
            const long at = b * M + r, from = r * nb + b;
            int8_t* dst = xqb + at * FK_QK;
            memcpy(dst, xq + from * FK_QK, FK_QK);
            xdb[at] = xd[from];
            xdb[M * nb + at] = xs ? xs[from] : 0.0f;
            if (xi) {
                int32_t sum = 0;
                for (int e = 0; e < FK_QK; e++) sum += dst[e];
                xi[at] = -8 * sum;
            }
#if defined(FK_VNNI)
            if (fmt == FK_Q8_0)
                for (int e = 0; e < FK_QK; e++) dst[e] = (int8_t)(dst[e] ^ (int8_t)0x80);
#endif
        }
    long chunk = FK_CHUNK_BYTES / K / FK_MR * FK_MR;
    if (chunk < FK_MR) chunk = FK_MR;
    const long ntiles = (N + FK_NR - 1) / FK_NR;
    fk_share sh;
    for (long c0 = 0; c0 < M; c0 += chunk) {
        const long c1 = c0 + chunk < M ? c0 + chunk : M;
#pragma omp parallel if (N * K * (c1 - c0) >= FK_PARALLEL_MIN)
        {
            fk_share_begin(&sh, ntiles);
            FK_SHARED_FOR(&sh, t, 4) { /* 4 tiles a claim, as the bf16 kernels */
                const long n0 = t * FK_NR, nr = N - n0 < FK_NR ? N - n0 : FK_NR;
                for (long m0 = c0; m0 < c1; m0 += FK_MR)
                    tile(xqb, xdb, xdb + M * nb, xi, w, bias, y, M, m0,
                         c1 - m0 < FK_MR ? c1 - m0 : FK_MR, n0, nr, N, K);
            }
        }
    }
    free(xqb);
    free(xdb);
    free(xi);
    return 0;
}

/* fk_quant_linear_tiles on float32 x and y (below, with the bf16 I/O). */
static int fk_tiles_f32(const float* x, const uint8_t* w, const float* bias, float* y, long M,
                        long N, long K, int fmt) {
    if (M < 1 || N < 1 || K < FK_QK || K % FK_QK || !fk_fmt_ok(fmt)) return -1;
    const long nb = K / FK_QK;
    int8_t* xq = (int8_t*)malloc((size_t)(M * K));
    float* xd = (float*)malloc(sizeof(float) * (size_t)(2 * M * nb));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -1;
    }
    fk_quantize_rows(x, M, K, xq, xd, xd + M * nb);
    int rc = fk_tiles(xq, xd, xd + M * nb, w, bias, y, M, N, K, fmt);
    free(xq);
    free(xd);
    return rc;
}

/* The tiles on quantized activations (see the top of the file). */
int fk_quant_linear_tiles_q8(const int8_t* xq, const float* xd, const float* xs, const uint8_t* w,
                             const float* bias, float* y, long M, long N, long K, int fmt) {
    if (M < 1 || N < 1 || K < FK_QK || K % FK_QK || !fk_fmt_ok(fmt)) return -1;
    return fk_tiles(xq, xd, xs, w, bias, y, M, N, K, fmt);
}

/* ------------------------------------------------------------------ bf16 in and out */
/* Argument `io` of the two float entry points: bit 0, x is bfloat16 (else float32); bit 1, y is
 * bfloat16 (else float32). A bf16 x is widened exactly; a bf16 y is rounded to nearest even
 * (fk_bf16.h, as torch's float32 -> bfloat16 conversion), so a caller holding bf16 tensors
 * gets the values of converting before and after, without two extra tensors a call. */
enum { FK_X_BF16 = 1, FK_Y_BF16 = 2 };

/* The few-row kernel (tiles == 0, strategy `mode`) or the tiles on x / y as `io` says. */
static int fk_with_io(int tiles, const void* x, const uint8_t* w, const float* bias, void* y,
                      long M, long N, long K, int fmt, int mode, int io) {
    if (io & ~(FK_X_BF16 | FK_Y_BF16) || M < 1 || N < 1 || K < 1) return -1;
    float* x32 = NULL;
    float* y32 = NULL;
    if (io & FK_X_BF16) {
        x32 = (float*)malloc(sizeof(float) * (size_t)(M * K));
        if (!x32) return -1;
        const uint16_t* h = (const uint16_t*)x;
        for (long e = 0; e < M * K; e++) x32[e] = fk_bf16_to_f32(h[e]);
    }
    if (io & FK_Y_BF16) {
        y32 = (float*)malloc(sizeof(float) * (size_t)(M * N));
        if (!y32) {
            free(x32);
            return -1;
        }
    }
    const float* xf = x32 ? x32 : (const float*)x;
    float* yf = y32 ? y32 : (float*)y;
    int rc = tiles ? fk_tiles_f32(xf, w, bias, yf, M, N, K, fmt)
                   : fk_linear_f32(xf, w, bias, yf, M, N, K, fmt, mode);
    if (rc == 0 && y32) {
        uint16_t* h = (uint16_t*)y;
        for (long e = 0; e < M * N; e++) h[e] = fk_f32_to_bf16(y32[e]);
    }
    free(x32);
    free(y32);
    return rc;
}

/*
 * x: [M, K] float32 or bfloat16 (io bit 0; 1 <= M <= 16); w: [N, K / 32 * block bytes]; bias:
 * [N] float32 or NULL; y: [M, N] float32 or bfloat16 (io bit 1). Returns 0, or -1 for a bad
 * argument or no memory (nothing written).
 */
int fk_quant_linear(const void* x, const uint8_t* w, const float* bias, void* y, long M, long N,
                    long K, int fmt, int mode, int io) {
    return fk_with_io(0, x, w, bias, y, M, N, K, fmt, mode, io);
}

/*
 * Any number of rows, int8 activations (see the top of the file); the arguments as for
 * fk_quant_linear.
 */
int fk_quant_linear_tiles(const void* x, const uint8_t* w, const float* bias, void* y, long M,
                          long N, long K, int fmt, int io) {
    return fk_with_io(1, x, w, bias, y, M, N, K, fmt, 0, io);
}

/*
 * The weight w ([N, K / 32 * block bytes]) dequantized into out ([N, K] float32): d * q (+ m)
 * per element, the float32 values ggml's dequantization gives. Returns 0, or -1 for a bad
 * argument.
 */
int fk_quant_dequantize(const uint8_t* w, float* out, long N, long K, int fmt) {
    if (N < 1 || K < FK_QK || K % FK_QK || !fk_fmt_ok(fmt)) return -1;
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
#pragma omp parallel for schedule(static) if (N * K >= FK_PARALLEL_MIN)
    for (long j = 0; j < N; j++) {
        for (long b = 0; b < nb; b++) {
            int8_t q[FK_QK];
            float m;
            float d = fk_block_ints(w + (j * nb + b) * bb, fmt, q, &m);
            float* o = out + j * K + b * FK_QK;
            for (int i = 0; i < FK_QK; i++) o[i] = d * (float)q[i] + m;
        }
    }
    return 0;
}
