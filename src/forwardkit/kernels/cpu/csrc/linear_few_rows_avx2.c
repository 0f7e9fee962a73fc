/* Linear for few rows on AVX2 + FMA CPUs: y[M,N] = x[M,K] @ w[N,K]^T (+ bias), M = 1..16 in
 * bf16 and 1..2 in float32; fk_linear_bf16_rows takes any number of bf16 rows (prompts). The AVX-512 twin is linear_few_rows.c; this file serves CPUs without it
 * (AMD Zen 1-3, older Intel), where decode is bound by streaming the weights just the same.
 *
 * AVX2 has no bf16 arithmetic, but a bf16 value is the upper half of a float32, so a 256-bit
 * load of 16 weights gives two float32 vectors with one instruction each: shifting every 32-bit
 * lane left by 16 yields the weights at even positions, masking off the low half yields those
 * at odd positions. The activation rows are split once per call into float32 even and odd
 * arrays (x[0::2], x[1::2]), so each 16 weights cost one load, one shift, one AND and two FMAs
 * per activation row; accumulation is float32, the bf16 result is rounded to nearest even once
 * (as PyTorch's bf16 matmul does). The summation order differs from oneDNN's, so results agree
 * with F.linear to float32 rounding of the sum, not bit for bit.
 *
 * As in the AVX-512 kernel, the weight is read in its plain row-major layout, a block of R rows
 * at a time, each row against every activation row; blocks are split over the OpenMP threads
 * (small products, whose weights sit in cache, stay on one thread); while a block is read the
 * next block's rows are prefetched one cache line per row and step (the hardware prefetchers
 * restart at every 4 KiB page and a row is a few KiB).
 *
 * Built at first use by forwardkit.kernels.cpu.native_linear with the system C compiler
 * (-mavx2 -mfma); the caller checks the CPU before calling.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fk_bf16.h"

#define FK_ABI_VERSION 2

int fk_abi_version(void) { return FK_ABI_VERSION; }


static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* Products small enough to sit in cache are not worth waking a second thread for. */
#define FK_PARALLEL_MIN (1L << 18)

/* bf16: `nr` (<= R) weight rows from n0 against MR activation rows given as float32 even/odd
 * halves xe/xo (K/2 each, row stride H = K/2 rounded down to 8). */
#define FK_BLOCK_BF16(MR, R)                                                                   \
  static void fkb_##MR##_##R(const float* xe, const float* xo, long H, const uint16_t* x,      \
                             const uint16_t* w, const uint16_t* bias, uint16_t* y, long n0,    \
                             long nr, long N, long K) {                                        \
    __m256 acc[MR][R];                                                                         \
    const uint16_t* wr[R];                                                                     \
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);                                    \
    for (int j = 0; j < R; j++) {                                                              \
      wr[j] = w + (n0 + (j < nr ? j : 0)) * K;                                                 \
      for (int i = 0; i < MR; i++) acc[i][j] = _mm256_setzero_ps();                            \
    }                                                                                          \
    long k = 0;                                                                                \
    for (; k + 32 <= K; k += 32) { /* one 64-byte line of every row per step */                \
      const long h = k / 2;                                                                    \
      __m256 xe0[MR], xo0[MR], xe1[MR], xo1[MR];                                               \
      for (int i = 0; i < MR; i++) {                                                           \
        xe0[i] = _mm256_loadu_ps(xe + i * H + h);                                              \
        xo0[i] = _mm256_loadu_ps(xo + i * H + h);                                              \
        xe1[i] = _mm256_loadu_ps(xe + i * H + h + 8);                                          \
        xo1[i] = _mm256_loadu_ps(xo + i * H + h + 8);                                          \
      }                                                                                        \
      for (int j = 0; j < R; j++) {                                                            \
        _mm_prefetch((const char*)(wr[j] + R * K + k), _MM_HINT_T0); /* next block's row j */  \
        __m256i a = _mm256_loadu_si256((const __m256i*)(wr[j] + k));                           \
        __m256i b = _mm256_loadu_si256((const __m256i*)(wr[j] + k + 16));                      \
        __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));                             \
        __m256 ao = _mm256_castsi256_ps(_mm256_and_si256(a, hi));                              \
        __m256 be = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));                             \
        __m256 bo = _mm256_castsi256_ps(_mm256_and_si256(b, hi));                              \
        for (int i = 0; i < MR; i++) {                                                         \
          acc[i][j] = _mm256_fmadd_ps(ae, xe0[i], acc[i][j]);                                  \
          acc[i][j] = _mm256_fmadd_ps(ao, xo0[i], acc[i][j]);                                  \
          acc[i][j] = _mm256_fmadd_ps(be, xe1[i], acc[i][j]);                                  \
          acc[i][j] = _mm256_fmadd_ps(bo, xo1[i], acc[i][j]);                                  \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < MR; i++)                                                               \
      for (int j = 0; j < nr; j++) {                                                           \
        float s = hsum(acc[i][j]);                                                             \
        for (long t = k; t < K; t++) s += fk_bf16_to_f32(wr[j][t]) * fk_bf16_to_f32(x[i * K + t]); \
        if (bias) s += fk_bf16_to_f32(bias[n0 + j]);                                           \
        y[i * N + n0 + j] = fk_f32_to_bf16(s);                                                 \
      }                                                                                        \
  }

FK_BLOCK_BF16(1, 8)
FK_BLOCK_BF16(2, 4)
FK_BLOCK_BF16(3, 2)
FK_BLOCK_BF16(4, 2)

/* bf16 rows beyond 2 (batched decode, 3..FK_MAX_ROWS_BF16): without native bf16 arithmetic
 * oneDNN widens the whole weight on every call, so streaming it here wins as long as the FMAs
 * keep up. A block of 8 weight rows is taken by one thread; the activation rows go through it
 * in groups of up to 4 (the block stays in L1/L2 between groups), each group against
 * sub-blocks of 2 weight rows (4 x 2 accumulators plus the widened weights fit the 16
 * registers). */
#define FK_MAX_ROWS_BF16 16

static void fkb_group(const float* xe, const float* xo, long H, const uint16_t* x,
                      const uint16_t* w, const uint16_t* bias, uint16_t* y, long n0, long nr,
                      long N, long K, long M) {
  for (long r0 = 0; r0 < M; r0 += 4) {
    const long g = M - r0 < 4 ? M - r0 : 4;
    const float* ge = xe + r0 * H;
    const float* go = xo + r0 * H;
    const uint16_t* gx = x + r0 * K;
    uint16_t* gy = y + r0 * N;
    for (long s = 0; s < nr; s += 2) {
      const long sr = nr - s < 2 ? nr - s : 2;
      switch (g) {
        case 1: fkb_1_8(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K); break;
        case 2: fkb_2_4(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K); break;
        case 3: fkb_3_2(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K); break;
        default: fkb_4_2(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K); break;
      }
    }
  }
}

int fk_max_rows_bf16(void) { return FK_MAX_ROWS_BF16; }

/* Returns 0 on success, -1 when M is outside 1..FK_MAX_ROWS_BF16 or memory is short (the
 * caller then uses another path). */
int fk_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                   long M, long N, long K) {
  if (M < 1 || M > FK_MAX_ROWS_BF16 || N < 1 || K < 1) return -1;
  const long H = K / 32 * 16; /* the even/odd halves of the part the vector loop covers */
  float* buf = (float*)malloc(sizeof(float) * (size_t)(2 * M * H + 1));
  if (!buf) return -1;
  float* xe = buf;
  float* xo = buf + M * H;
  for (long i = 0; i < M; i++)
    for (long h = 0; h < H; h++) {
      xe[i * H + h] = fk_bf16_to_f32(x[i * K + 2 * h]);
      xo[i * H + h] = fk_bf16_to_f32(x[i * K + 2 * h + 1]);
    }
  const long R = M == 1 ? 8 : M == 2 ? 4 : 8;
  const long nblocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if (N * K * (M > 2 ? M : 1) >= FK_PARALLEL_MIN)
  for (long b = 0; b < nblocks; b++) {
    const long n0 = b * R;
    const long nr = N - n0 < R ? N - n0 : R;
    if (M == 1) fkb_1_8(xe, xo, H, x, w, bias, y, n0, nr, N, K);
    else if (M == 2) fkb_2_4(xe, xo, H, x, w, bias, y, n0, nr, N, K);
    else fkb_group(xe, xo, H, x, w, bias, y, n0, nr, N, K, M);
  }
  free(buf);
  return 0;
}

/* bf16, any number of rows (prompts: more rows than fk_linear_bf16 takes). A CPU without
 * native bf16 arithmetic has no fast bf16 matmul (oneDNN widens the weight on every call, or
 * PyTorch emulates the products), so this blocked kernel serves them: the activations are
 * widened to float32 once, a chunk of rows at a time (the chunk's even/odd halves stay in L2),
 * and every block of 8 weight rows (one thread's, in L1/L2) meets every group of 4 activation
 * rows of the chunk as 4 x 2 register tiles of float32 FMAs, each weight widened in registers.
 * No float32 copy of the weight is made. */
#define FK_CHUNK_BYTES (512L << 10) /* float32 activation halves per chunk of rows */

int fk_linear_bf16_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                        long M, long N, long K) {
  if (M < 1 || N < 1 || K < 1) return -1;
  const long H = K / 32 * 16;
  long chunk = FK_CHUNK_BYTES / (long)sizeof(float) / (K > 32 ? K : 32) / 4 * 4;
  if (chunk < 4) chunk = 4;
  if (chunk > M) chunk = M;
  float* buf = (float*)malloc(sizeof(float) * (size_t)(2 * chunk * H + 1));
  if (!buf) return -1;
  float* xe = buf;
  float* xo = buf + chunk * H;
  const long R = 8;
  const long nblocks = (N + R - 1) / R;
  for (long c0 = 0; c0 < M; c0 += chunk) {
    const long rows = M - c0 < chunk ? M - c0 : chunk;
    const uint16_t* cx = x + c0 * K;
    for (long i = 0; i < rows; i++)
      for (long h = 0; h < H; h++) {
        xe[i * H + h] = fk_bf16_to_f32(cx[i * K + 2 * h]);
        xo[i * H + h] = fk_bf16_to_f32(cx[i * K + 2 * h + 1]);
      }
#pragma omp parallel for schedule(static) if (N * K * rows >= FK_PARALLEL_MIN)
    for (long b = 0; b < nblocks; b++) {
      const long n0 = b * R;
      const long nr = N - n0 < R ? N - n0 : R;
      fkb_group(xe, xo, H, cx, w, bias, y + c0 * N, n0, nr, N, K, rows);
    }
  }
  free(buf);
  return 0;
}

/* float32: the same blocking, 16 floats (one cache line) per row and step. */
#define FK_BLOCK_F32(MR, R)                                                                    \
  static void fkf_##MR##_##R(const float* x, const float* w, const float* bias, float* y,      \
                             long n0, long nr, long N, long K) {                               \
    __m256 acc[MR][R];                                                                         \
    const float* wr[R];                                                                        \
    for (int j = 0; j < R; j++) {                                                              \
      wr[j] = w + (n0 + (j < nr ? j : 0)) * K;                                                 \
      for (int i = 0; i < MR; i++) acc[i][j] = _mm256_setzero_ps();                            \
    }                                                                                          \
    long k = 0;                                                                                \
    for (; k + 16 <= K; k += 16) {                                                             \
      __m256 x0[MR], x1[MR];                                                                   \
      for (int i = 0; i < MR; i++) {                                                           \
        x0[i] = _mm256_loadu_ps(x + i * K + k);                                                \
        x1[i] = _mm256_loadu_ps(x + i * K + k + 8);                                            \
      }                                                                                        \
      for (int j = 0; j < R; j++) {                                                            \
        _mm_prefetch((const char*)(wr[j] + R * K + k), _MM_HINT_T0); /* next block's row j */  \
        __m256 a = _mm256_loadu_ps(wr[j] + k);                                                 \
        __m256 b = _mm256_loadu_ps(wr[j] + k + 8);                                             \
        for (int i = 0; i < MR; i++) {                                                         \
          acc[i][j] = _mm256_fmadd_ps(a, x0[i], acc[i][j]);                                    \
          acc[i][j] = _mm256_fmadd_ps(b, x1[i], acc[i][j]);                                    \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < MR; i++)                                                               \
      for (int j = 0; j < nr; j++) {                                                           \
        float s = hsum(acc[i][j]);                                                             \
        for (long t = k; t < K; t++) s += wr[j][t] * x[i * K + t];                             \
        y[i * N + n0 + j] = s + (bias ? bias[n0 + j] : 0.0f);                                  \
      }                                                                                        \
  }

FK_BLOCK_F32(1, 8)
FK_BLOCK_F32(2, 4)

int fk_linear_f32(const float* x, const float* w, const float* bias, float* y, long M, long N,
                  long K) {
  if (M < 1 || M > 2 || N < 1 || K < 1) return -1;
  const long R = M == 1 ? 8 : 4;
  const long nblocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static) if (N * K >= FK_PARALLEL_MIN)
  for (long b = 0; b < nblocks; b++) {
    const long n0 = b * R;
    const long nr = N - n0 < R ? N - n0 : R;
    if (M == 1) fkf_1_8(x, w, bias, y, n0, nr, N, K);
    else fkf_2_4(x, w, bias, y, n0, nr, N, K);
  }
  return 0;
}
