/* Linear for few rows on the CPU: y[M,N] = x[M,K] @ w[N,K]^T (+ bias), in bf16 (AVX-512-BF16)
 * and float32 (AVX-512F).
 *
 * Decoding multiplies one to a few activation rows by each weight matrix, so the product is
 * bound by how fast the weights stream from memory. The weight is read in its plain row-major
 * layout (no packed copy), a block of R rows at a time, each row against every activation row,
 * with fp32 accumulation by VDPBF16PS (32 products per instruction). Rows blocks are split
 * over the OpenMP threads of the process (the same runtime as PyTorch's). A bf16 result is
 * rounded to bf16 (round to nearest even), as PyTorch's bf16 matmul does. While a block is
 * read, the next block (the R*K elements that follow it) is prefetched one cache line per row
 * and step: each weight row is a few KiB, and the hardware prefetchers restart at every 4 KiB
 * page, so without it every row began with a memory stall (measured on the 2-core Xeon, all of
 * a 1B model's weights, 4 KiB or huge pages alike: 24.8 -> 28.1 GB/s). One sequence's bf16
 * decode does better still reading 4 rows far apart (one from each of 4 contiguous parts of a
 * thread's rows), 4 long sequential streams with no software prefetch. Each function uses
 * only the instructions its name needs; the caller checks the CPU before calling.
 *
 * Built at first use by forwardkit.kernels.cpu.native_linear with the system C compiler.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "fk_bf16.h"
#include "fk_streams.h"

#define FK_ABI_VERSION 2
#define FK_STREAMS 4 /* one-row decode: sequential streams per thread */

int fk_abi_version(void) { return FK_ABI_VERSION; }


/* One block of `nr` (<= R) weight rows starting at n0 against MR activation rows starting at m0. */
#define FK_BLOCK(MR, R)                                                                        \
  static void fk_block_##MR##_##R(const uint16_t* x, const uint16_t* w, const uint16_t* bias,  \
                                  uint16_t* y, long m0, long n0, long nr, long N, long K,      \
                                  long rs) {                                                   \
    __m512 acc[MR][R];                                                                         \
    const uint16_t* wr[R];                                                                     \
    for (int j = 0; j < R; j++) {                                                              \
      wr[j] = w + (n0 + (j < nr ? j : 0) * rs) * K;                                            \
      for (int i = 0; i < MR; i++) acc[i][j] = _mm512_setzero_ps();                            \
    }                                                                                          \
    long k = 0;                                                                                \
    for (; k + 32 <= K; k += 32) {                                                             \
      __m512bh xv[MR];                                                                         \
      for (int i = 0; i < MR; i++)                                                             \
        xv[i] = (__m512bh)_mm512_loadu_si512((const void*)(x + (m0 + i) * K + k));             \
      for (int j = 0; j < R; j++) {                                                            \
        if (rs == 1) /* the next block's row j */                                              \
          _mm_prefetch((const char*)(wr[j] + R * K + k), _MM_HINT_T0);                         \
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wr[j] + k));                  \
        for (int i = 0; i < MR; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[i]);       \
      }                                                                                        \
    }                                                                                          \
    if (k < K) { /* tail: masked loads read zeros past K */                                    \
      __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);                                     \
      __m512bh xv[MR];                                                                         \
      for (int i = 0; i < MR; i++)                                                             \
        xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(x + (m0 + i) * K + k)); \
      for (int j = 0; j < R; j++) {                                                            \
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(wr[j] + k));      \
        for (int i = 0; i < MR; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[i]);       \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < MR; i++)                                                               \
      for (int j = 0; j < nr; j++) {                                                           \
        float s = _mm512_reduce_add_ps(acc[i][j]);                                             \
        if (bias) s += fk_bf16_to_f32(bias[n0 + j * rs]);                                      \
        y[(m0 + i) * N + n0 + j * rs] = fk_f32_to_bf16(s);                                     \
      }                                                                                        \
  }

FK_BLOCK(1, 8)
FK_BLOCK(1, 4) /* FK_STREAMS rows far apart */
FK_BLOCK(2, 8)
FK_BLOCK(3, 4)
FK_BLOCK(4, 4)

/* float32: the same blocking with FMA over 16 floats. Needs AVX-512F only. */
#define FK_BLOCK32(MR, R)                                                                      \
  static void fk32_block_##MR##_##R(const float* x, const float* w, const float* bias,        \
                                    float* y, long n0, long nr, long N, long K, long rs) {     \
    __m512 acc[MR][R];                                                                         \
    const float* wr[R];                                                                        \
    for (int j = 0; j < R; j++) {                                                              \
      wr[j] = w + (n0 + (j < nr ? j : 0) * rs) * K;                                            \
      for (int i = 0; i < MR; i++) acc[i][j] = _mm512_setzero_ps();                            \
    }                                                                                          \
    long k = 0;                                                                                \
    for (; k + 16 <= K; k += 16) {                                                             \
      __m512 xv[MR];                                                                           \
      for (int i = 0; i < MR; i++) xv[i] = _mm512_loadu_ps(x + i * K + k);                     \
      for (int j = 0; j < R; j++) {                                                            \
        if (rs == 1) /* the next block's row j */                                              \
          _mm_prefetch((const char*)(wr[j] + R * K + k), _MM_HINT_T0);                         \
        __m512 wv = _mm512_loadu_ps(wr[j] + k);                                                \
        for (int i = 0; i < MR; i++) acc[i][j] = _mm512_fmadd_ps(wv, xv[i], acc[i][j]);        \
      }                                                                                        \
    }                                                                                          \
    if (k < K) {                                                                               \
      __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);                                       \
      __m512 xv[MR];                                                                           \
      for (int i = 0; i < MR; i++) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * K + k);         \
      for (int j = 0; j < R; j++) {                                                            \
        __m512 wv = _mm512_maskz_loadu_ps(mask, wr[j] + k);                                    \
        for (int i = 0; i < MR; i++) acc[i][j] = _mm512_fmadd_ps(wv, xv[i], acc[i][j]);        \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < MR; i++)                                                               \
      for (int j = 0; j < nr; j++)                                                             \
        y[i * N + n0 + j * rs] =                                                               \
            _mm512_reduce_add_ps(acc[i][j]) + (bias ? bias[n0 + j * rs] : 0.0f);               \
  }

FK_BLOCK32(1, 8)
FK_BLOCK32(1, 4) /* FK_STREAMS rows far apart */
FK_BLOCK32(2, 8)

int fk_linear_f32(const float* x, const float* w, const float* bias, float* y, long M, long N,
                  long K) {
  if (M < 1 || M > 2 || N < 1 || K < 1) return -1;
  if (M == 1 && N * K >= (1L << 18)) { /* as in fk_linear_bf16: FK_STREAMS streams */
    fk_share sh;
#pragma omp parallel
    {
      const fk_parts q = fk_streams_begin(&sh, N, FK_STREAMS);
      FK_SHARED_STEPS(&sh, N, FK_STREAMS, 8, r, per)
        fk32_block_1_4(x, w, bias, y, r, FK_STREAMS, N, K, per);
      for (long j = q.lo + FK_STREAMS * q.per; j < q.hi; j++)
        fk32_block_1_8(x, w, bias, y, j, 1, N, K, 1);
    }
    return 0;
  }
  const long R = 8;
  const long nblocks = (N + R - 1) / R;
  fk_share sh;
  /* small products (weights in cache) are not worth waking a second thread for */
#pragma omp parallel if (N * K >= (1L << 18))
  {
    fk_share_begin(&sh, nblocks);
    FK_SHARED_FOR(&sh, b, 2) {
      const long n0 = b * R;
      const long nr = N - n0 < R ? N - n0 : R;
      if (M == 1) fk32_block_1_8(x, w, bias, y, n0, nr, N, K, 1);
      else fk32_block_2_8(x, w, bias, y, n0, nr, N, K, 1);
    }
  }
  return 0;
}

/* Returns 0 on success, -1 when M is outside 1..4 (the caller then uses another path). */
int fk_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                   long M, long N, long K) {
  if (M < 1 || M > 4 || N < 1 || K < 1) return -1;
  if (M == 1 && N * K >= (1L << 18)) {
    /* One sequence's decode: FK_STREAMS long streams a thread (fk_streams.h; the same sums as
     * blocks of adjacent rows, bit for bit). 12 bf16 weights of the 1B shape, 2 threads:
     * 40.2-40.7 GB/s for blocks of 8 adjacent rows, 57.8-58.2 for 4 streams, 49.2 for 8. */
    fk_share sh;
#pragma omp parallel
    {
      const fk_parts q = fk_streams_begin(&sh, N, FK_STREAMS);
      FK_SHARED_STEPS(&sh, N, FK_STREAMS, 8, r, per)
        fk_block_1_4(x, w, bias, y, 0, r, FK_STREAMS, N, K, per);
      for (long j = q.lo + FK_STREAMS * q.per; j < q.hi; j++)
        fk_block_1_8(x, w, bias, y, 0, j, 1, N, K, 1);
    }
    return 0;
  }
  const long R = M <= 2 ? 8 : 4;
  const long nblocks = (N + R - 1) / R;
  fk_share sh;
#pragma omp parallel
  {
    fk_share_begin(&sh, nblocks);
    FK_SHARED_FOR(&sh, b, 2) {
      const long n0 = b * R;
      const long nr = N - n0 < R ? N - n0 : R;
      switch (M) {
        case 1: fk_block_1_8(x, w, bias, y, 0, n0, nr, N, K, 1); break;
        case 2: fk_block_2_8(x, w, bias, y, 0, n0, nr, N, K, 1); break;
        case 3: fk_block_3_4(x, w, bias, y, 0, n0, nr, N, K, 1); break;
        default: fk_block_4_4(x, w, bias, y, 0, n0, nr, N, K, 1); break;
      }
    }
  }
  return 0;
}
