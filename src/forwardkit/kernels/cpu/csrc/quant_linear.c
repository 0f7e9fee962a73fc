/*
 * forwardkit's native few-row linear over block-quantized weights (q8_0, q4_0: the GGUF block
 * layouts, 32 weights a block, fp16 scale first).
 *
 *   y[r, j] = sum_k x[r, k] * W[j, k] (+ bias[j])   for r < M (1..16 rows), j < N
 *
 * Portable C, compiled per ISA (AVX-512, AVX2 + FMA + F16C, or the compiler's baseline) by
 * forwardkit.kernels.cpu.native_quant and vectorised by the compiler: every inner loop runs over
 * the 32 lanes of a block with no reduction inside it (partial sums stay per lane), so no
 * reassociation flag is needed.
 *
 * Two strategies (argument `mode`):
 *   0 (float)  each weight block is dequantized in registers (d * q as float32) and multiplied
 *              into float32 activations: the products are those of dequantize-then-matmul.
 *   1 (int8)   the activations are quantized per block of 32 to int8 with one float scale
 *              (ggml's q8_0 rounding), each block's dot product is an integer sum of int8
 *              products, scaled by d_w * d_x (what llama.cpp's CPU backend does).
 *
 * Activation rows are taken in groups of 4, the remainder one at a time; a weight row (at most a
 * few KB) stays in L1 while every group passes over it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define FK_QUANT_ABI_VERSION 1
#define FK_QK 32
#define FK_G 4
#define FK_MAX_ROWS 16
#define FK_PARALLEL_MIN (1L << 18) /* weight elements below which one thread serves */

enum { FK_Q8_0 = 0, FK_Q4_0 = 1 };

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

static inline long fk_block_bytes(int fmt) { return fmt == FK_Q8_0 ? 2 + FK_QK : 2 + FK_QK / 2; }

/* The 32 integer values of a block (q8_0: q; q4_0: nibble - 8) and its scale. */
static inline float fk_block_ints(const uint8_t* blk, int fmt, int8_t* q) {
    if (fmt == FK_Q8_0) {
        memcpy(q, blk + 2, FK_QK);
    } else {
        for (int i = 0; i < FK_QK / 2; i++) {
            q[i] = (int8_t)((blk[2 + i] & 0x0F) - 8);
            q[i + FK_QK / 2] = (int8_t)((blk[2 + i] >> 4) - 8);
        }
    }
    return fk_half(blk);
}

#define FK_INLINE static inline __attribute__((always_inline))

#if defined(__AVX2__)
static inline __m256i fk_block_vec(const uint8_t* blk, int fmt);
static inline float fk_hsum(__m256 v);

/* One weight row against G (1 or FK_G, a constant after inlining) activation rows, float:
 * each block's 32 weights widened to 4 x 8 floats, scaled, multiplied into x. */
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
        for (int r = 0; r < G; r++) {
            const float* xr = x + r * K + b * FK_QK;
            for (int v = 0; v < 4; v++) acc[r] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xr + 8 * v), acc[r]);
        }
    }
    for (int r = 0; r < G; r++) sums[r] = fk_hsum(acc[r]);
}
#else

/* One weight row against G (1 or FK_G, a constant after inlining) activation rows, float. */
FK_INLINE void fk_row_float(const float* x, long K, const uint8_t* wrow, int fmt, const int G,
                            float* sums) {
    float acc[FK_G][FK_QK];
    memset(acc, 0, sizeof acc);
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
    for (long b = 0; b < nb; b++) {
        int8_t q[FK_QK];
        float w[FK_QK];
        float d = fk_block_ints(wrow + b * bb, fmt, q);
        for (int i = 0; i < FK_QK; i++) w[i] = d * (float)q[i];
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
#endif

/* One weight row against G int8 activation rows (xq, scales xd), int8 strategy. */
#if defined(__AVX2__)
/* 32 signed int8 weights of a block in one register (q4_0: low nibbles are elements 0-15, high
 * nibbles 16-31, minus 8). */
static inline __m256i fk_block_vec(const uint8_t* blk, int fmt) {
    if (fmt == FK_Q8_0) return _mm256_loadu_si256((const __m256i*)(blk + 2));
    __m128i packed = _mm_loadu_si128((const __m128i*)(blk + 2));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
}

/* Sum of the 32 int8 products of w and x, as 8 int32 lanes (|x| * sign-adjusted w pairs). */
static inline __m256i fk_dot_i8(__m256i w, __m256i x) {
    __m256i ax = _mm256_sign_epi8(x, x), sw = _mm256_sign_epi8(w, x);
    __m256i pairs = _mm256_maddubs_epi16(ax, sw);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

static inline float fk_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

FK_INLINE void fk_row_int8(const int8_t* xq, const float* xd, long K, const uint8_t* wrow, int fmt,
                           const int G, float* sums) {
    __m256 acc[FK_G];
    for (int r = 0; r < G; r++) acc[r] = _mm256_setzero_ps();
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
    }
    for (int r = 0; r < G; r++) sums[r] = fk_hsum(acc[r]);
}
#else
FK_INLINE void fk_row_int8(const int8_t* xq, const float* xd, long K, const uint8_t* wrow, int fmt,
                           const int G, float* sums) {
    float acc[FK_G] = {0.0f, 0.0f, 0.0f, 0.0f};
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
    for (long b = 0; b < nb; b++) {
        int8_t q[FK_QK];
        float d = fk_block_ints(wrow + b * bb, fmt, q);
        for (int r = 0; r < G; r++) {
            const int8_t* xr = xq + r * K + b * FK_QK;
            int32_t s = 0;
            for (int i = 0; i < FK_QK; i++) s += (int32_t)q[i] * (int32_t)xr[i];
            acc[r] += (d * xd[r * nb + b]) * (float)s;
        }
    }
    for (int r = 0; r < G; r++) sums[r] = acc[r];
}
#endif

/* ggml's q8_0 rounding of activation blocks: d = max|x| / 127, q = roundf(x / d). */
static void fk_quantize_rows(const float* x, long rows, long K, int8_t* xq, float* xd) {
    long nb = K / FK_QK;
    for (long r = 0; r < rows; r++) {
        for (long b = 0; b < nb; b++) {
            const float* v = x + r * K + b * FK_QK;
            float amax = 0.0f;
            for (int i = 0; i < FK_QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int i = 0; i < FK_QK; i++) xq[r * K + b * FK_QK + i] = (int8_t)roundf(v[i] * id);
            xd[r * nb + b] = d;
        }
    }
}

/* Rows [r0, r0 + G) of y for weight row j. */
FK_INLINE void fk_rows(const float* x, const int8_t* xq, const float* xd, const uint8_t* wrow,
                       float add, float* y, long r0, long N, long K, long j, int fmt, int mode,
                       const int G) {
    float sums[FK_G];
    long nb = K / FK_QK;
    if (mode == 0)
        fk_row_float(x + r0 * K, K, wrow, fmt, G, sums);
    else
        fk_row_int8(xq + r0 * K, xd + r0 * nb, K, wrow, fmt, G, sums);
    for (int r = 0; r < G; r++) y[(r0 + r) * N + j] = sums[r] + add;
}

/*
 * x: [M, K] float32 (1 <= M <= 16); w: [N, K / 32 * block bytes]; bias: [N] float32 or NULL;
 * y: [M, N] float32. Returns 0, or -1 for a bad argument (nothing written).
 */
int fk_quant_linear(const float* x, const uint8_t* w, const float* bias, float* y, long M, long N,
                    long K, int fmt, int mode) {
    if (M < 1 || M > FK_MAX_ROWS || N < 1 || K < FK_QK || K % FK_QK ||
        (fmt != FK_Q8_0 && fmt != FK_Q4_0) || (mode != 0 && mode != 1))
        return -1;
    long full = M / FK_G * FK_G, nb = K / FK_QK, row_bytes = nb * fk_block_bytes(fmt);
    int8_t* xq = NULL;
    float* xd = NULL;
    if (mode == 1) {
        xq = (int8_t*)malloc((size_t)(M * K));
        xd = (float*)malloc(sizeof(float) * (size_t)(M * nb));
        if (!xq || !xd) {
            free(xq);
            free(xd);
            return -1;
        }
        fk_quantize_rows(x, M, K, xq, xd);
    }
#pragma omp parallel for schedule(static) if (N * K >= FK_PARALLEL_MIN)
    for (long j = 0; j < N; j++) {
        const uint8_t* wrow = w + j * row_bytes;
        float add = bias ? bias[j] : 0.0f;
        for (long r0 = 0; r0 < full; r0 += FK_G)
            fk_rows(x, xq, xd, wrow, add, y, r0, N, K, j, fmt, mode, FK_G);
        for (long r0 = full; r0 < M; r0++)
            fk_rows(x, xq, xd, wrow, add, y, r0, N, K, j, fmt, mode, 1);
    }
    free(xq);
    free(xd);
    return 0;
}

/*
 * The weight w ([N, K / 32 * block bytes]) dequantized into out ([N, K] float32): d * q per
 * element, the float32 values ggml's dequantization gives. For products of more rows than the
 * few-row kernel serves. Returns 0, or -1 for a bad argument.
 */
int fk_quant_dequantize(const uint8_t* w, float* out, long N, long K, int fmt) {
    if (N < 1 || K < FK_QK || K % FK_QK || (fmt != FK_Q8_0 && fmt != FK_Q4_0)) return -1;
    long nb = K / FK_QK, bb = fk_block_bytes(fmt);
#pragma omp parallel for schedule(static) if (N * K >= FK_PARALLEL_MIN)
    for (long j = 0; j < N; j++) {
        for (long b = 0; b < nb; b++) {
            int8_t q[FK_QK];
            float d = fk_block_ints(w + (j * nb + b) * bb, fmt, q);
            float* o = out + j * K + b * FK_QK;
            for (int i = 0; i < FK_QK; i++) o[i] = d * (float)q[i];
        }
    }
    return 0;
}
