/* Linear on AVX2 + FMA CPUs: y[M,N] = x[M,K] @ w[N,K]^T (+ bias). fk_linear_bf16 serves 1..16
 * bf16 rows (decode: 1..5 rows by the dot-product tiles, 6..16 by the broadcast kernel),
 * fk_linear_f32 1..2 float32 rows, fk_linear_bf16_rows any number of bf16 rows (prompts).
 * The AVX-512 twin is
 * linear_few_rows.c; this file serves CPUs without it (AMD Zen 1-3, older Intel), where decode
 * is bound by streaming the weights just the same and prompts by the float32 FMAs.
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
 * The few-row kernels read the weight, as the AVX-512 kernel does, in its plain row-major
 * layout: one sequence's decode takes one row from each of 4 contiguous parts of a thread's
 * rows at a time (4 long sequential streams the hardware prefetchers follow); more activation
 * rows take blocks of R adjacent rows, each row against every activation row, with the next
 * block's rows prefetched one cache line per row and step (the hardware prefetchers restart
 * at every 4 KiB page and a row is a few KiB). Small products, whose weights sit in cache, stay
 * on one thread.
 *
 * Built at first use by forwardkit.kernels.cpu.native_linear with the system C compiler
 * (-mavx2 -mfma); the caller checks the CPU before calling.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fk_bf16.h"
#include "fk_share.h"
#include "fk_streams.h"

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

/* bf16: `nr` (<= R) weight rows n0, n0 + rs, ... against MR activation rows given as float32
 * even/odd halves xe/xo (K/2 each, row stride H = K/2 rounded down to 8). Adjacent rows
 * (rs = 1) prefetch the next block's; rows far apart (one sequence's decode) do not. */
#define FK_BLOCK_BF16(MR, R)                                                                   \
  static void fkb_##MR##_##R(const float* xe, const float* xo, long H, const uint16_t* x,      \
                             const uint16_t* w, const uint16_t* bias, uint16_t* y, long n0,    \
                             long nr, long N, long K, long rs) {                               \
    __m256 acc[MR][R];                                                                         \
    const uint16_t* wr[R];                                                                     \
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);                                    \
    for (int j = 0; j < R; j++) {                                                              \
      wr[j] = w + (n0 + (j < nr ? j : 0) * rs) * K;                                            \
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
        if (rs == 1) /* the next block's row j */                                              \
          _mm_prefetch((const char*)(wr[j] + R * K + k), _MM_HINT_T0);                         \
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
        if (bias) s += fk_bf16_to_f32(bias[n0 + j * rs]);                                      \
        y[i * N + n0 + j * rs] = fk_f32_to_bf16(s);                                            \
      }                                                                                        \
  }

FK_BLOCK_BF16(1, 8)
FK_BLOCK_BF16(1, 4) /* FK_STREAMS rows far apart */
FK_BLOCK_BF16(2, 4)
FK_BLOCK_BF16(3, 2)
FK_BLOCK_BF16(4, 2)

/* bf16 rows beyond 2 (batched decode, 3..FK_BC_MIN_ROWS - 1): without native bf16 arithmetic
 * oneDNN widens the whole weight on every call, so streaming it here wins as long as the FMAs
 * keep up (from 6 rows the broadcast kernel below is faster).
 * A block of 8 weight rows is taken by one thread; the activation rows go through it
 * in groups of up to 4 (the block stays in L1/L2 between groups), each group against
 * sub-blocks of 2 weight rows (4 x 2 accumulators plus the widened weights fit the 16
 * registers). */
#define FK_MAX_ROWS_BF16 16
#define FK_STREAMS 4 /* one-row decode: sequential streams per thread */

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
        case 1: fkb_1_8(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K, 1); break;
        case 2: fkb_2_4(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K, 1); break;
        case 3: fkb_3_2(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K, 1); break;
        default: fkb_4_2(ge, go, H, gx, w, bias, gy, n0 + s, sr, N, K, 1); break;
      }
    }
  }
}

int fk_max_rows_bf16(void) { return FK_MAX_ROWS_BF16; }

/* bf16, 6..16 rows (batched decode): the weights broadcast, the activations as vectors.
 *
 * The activation rows are widened once per call into a float32 panel laid out [k][V] (V = 8
 * or 16 rows, short rows zero), one or two vectors per k. NF weight rows are streamed in
 * their plain layout, one bf16 value each per k: a 4-byte broadcast load from one element
 * before it puts the value in the upper half of every 32-bit lane, the element before it in
 * the lower half, and an AND with 0xffff0000 leaves exactly the float32 of the bf16 value.
 * So each weight costs one load (a load-port uop), one AND (on any vector ALU port) and one
 * FMA per activation vector, with no packing and no horizontal sums: NF rows x (V / 8)
 * accumulators stay in registers across the whole of k (16 rows: 6 weight rows, 12
 * accumulators, 2 activation vectors, the mask and the broadcast fill the 16 registers).
 *
 * Each output sums its k-values in order in one float32 accumulator, as the packed GEMM below
 * does: the same bits as fk_linear_bf16_rows. 1B-shape products on the AMX Xeon built for
 * AVX2, 2 threads, medians of 7 (GFLOPS, packed GEMM -> this): 16 rows 120-141 -> 160-186,
 * 12 rows 109-125 -> 125-134, 8 rows 84-98 -> 126-140, 6 rows 76-89 -> 92-100; at 4 rows the
 * dot-product tiles stay ahead (about 110 against 65). The kernels are kept out of line: inlined
 * into the OpenMP loop, GCC spilled two of the 12 accumulators (117 instead of 177 GFLOPS). */
#define FK_BC_MIN_ROWS 6

static inline __m256 fkc_w(const uint16_t* p, __m256 mask) {
  int v;
  memcpy(&v, p - 1, 4); /* (p[-1], p[0]): p[0] in the upper half of the dword */
  return _mm256_and_ps(_mm256_castsi256_ps(_mm256_set1_epi32(v)), mask);
}

/* NF weight rows w + n0 * K ... against the panel xp[k][8 * V]; out[j][8 * V] the sums */
#define FK_BCAST(V, NF)                                                                        \
  static __attribute__((noinline)) void fkc_##V##_##NF(const float* xp, const uint16_t* w,      \
                                                        long K, long n0, float* out) {         \
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u));             \
    const uint16_t* wr[NF];                                                                    \
    __m256 a[NF][V];                                                                           \
    for (int j = 0; j < NF; j++) {                                                             \
      wr[j] = w + (n0 + j) * K;                                                                \
      const __m256 w0 = _mm256_set1_ps(fk_bf16_to_f32(wr[j][0]));                              \
      for (int v = 0; v < V; v++) a[j][v] = _mm256_mul_ps(w0, _mm256_loadu_ps(xp + 8 * v));    \
    }                                                                                          \
    for (long k = 1; k < K; k++) {                                                             \
      __m256 xv[V];                                                                            \
      for (int v = 0; v < V; v++) xv[v] = _mm256_loadu_ps(xp + (8 * V) * k + 8 * v);          \
      for (int j = 0; j < NF; j++) {                                                           \
        const __m256 wv = fkc_w(wr[j] + k, mask);                                              \
        for (int v = 0; v < V; v++) a[j][v] = _mm256_fmadd_ps(wv, xv[v], a[j][v]);             \
      }                                                                                        \
    }                                                                                          \
    for (int j = 0; j < NF; j++)                                                               \
      for (int v = 0; v < V; v++) _mm256_storeu_ps(out + (8 * V) * j + 8 * v, a[j][v]);        \
  }
FK_BCAST(1, 1)
FK_BCAST(1, 8)
FK_BCAST(2, 1)
FK_BCAST(2, 6)

static int fk_linear_bf16_bcast(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                uint16_t* y, long M, long N, long K) {
  const int V = M > 8 ? 2 : 1;
  const long NF = V == 2 ? 6 : 8, W = 8 * V;
  float* xp = (float*)aligned_alloc(64, sizeof(float) * (size_t)(W * K));
  if (!xp) return -1;
  for (long k = 0; k < K; k++)
    for (long m = 0; m < W; m++) xp[k * W + m] = m < M ? fk_bf16_to_f32(x[m * K + k]) : 0.0f;
  const long ng = (N + NF - 1) / NF;
  fk_share sh;
#pragma omp parallel if (N * K * M >= FK_PARALLEL_MIN)
  {
    float out[8 * 16];
    fk_share_begin(&sh, ng);
    FK_SHARED_FOR(&sh, g, 4) { /* 4 groups a claim: 1 cost 2-3 % at 16 rows */
      const long n0 = g * NF, nf = N - n0 < NF ? N - n0 : NF;
      if (nf == NF) {
        if (V == 2) fkc_2_6(xp, w, K, n0, out);
        else fkc_1_8(xp, w, K, n0, out);
      } else { /* the short last group: one weight row at a time */
        for (long j = 0; j < nf; j++) {
          if (V == 2) fkc_2_1(xp, w, K, n0 + j, out + W * j);
          else fkc_1_1(xp, w, K, n0 + j, out + W * j);
        }
      }
      for (long j = 0; j < nf; j++)
        for (long m = 0; m < M; m++) {
          float s = out[W * j + m];
          if (bias) s += fk_bf16_to_f32(bias[n0 + j]);
          y[m * N + n0 + j] = fk_f32_to_bf16(s);
        }
    }
  }
  free(xp);
  return 0;
}

/* Returns 0 on success, -1 when M is outside 1..FK_MAX_ROWS_BF16 or memory is short (the
 * caller then uses another path). */
int fk_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                   long M, long N, long K) {
  if (M < 1 || M > FK_MAX_ROWS_BF16 || N < 1 || K < 1) return -1;
  if (M >= FK_BC_MIN_ROWS) return fk_linear_bf16_bcast(x, w, bias, y, M, N, K);
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
  if (M == 1 && N * K >= FK_PARALLEL_MIN) {
    /* One sequence's decode: FK_STREAMS long streams a thread (fk_streams.h; the same sums as
     * blocks of adjacent rows, bit for bit). 12 bf16 weights of the 1B shape, 2 threads:
     * 30.3-30.9 GB/s for blocks of 8 adjacent rows, 34.8-36.0 for 4 streams, 34.1-34.4 for 8. */
    fk_share sh;
#pragma omp parallel
    {
      const fk_parts q = fk_streams_begin(&sh, N, FK_STREAMS);
      FK_SHARED_STEPS(&sh, N, FK_STREAMS, 8, r, per)
        fkb_1_4(xe, xo, H, x, w, bias, y, r, FK_STREAMS, N, K, per);
      for (long j = q.lo + FK_STREAMS * q.per; j < q.hi; j++) /* the part's last rows */
        fkb_1_8(xe, xo, H, x, w, bias, y, j, 1, N, K, 1);
    }
    free(buf);
    return 0;
  }
  const long R = M == 1 ? 8 : M == 2 ? 4 : 8;
  const long nblocks = (N + R - 1) / R;
  fk_share sh;
#pragma omp parallel if (N * K * (M > 2 ? M : 1) >= FK_PARALLEL_MIN)
  {
    fk_share_begin(&sh, nblocks);
    FK_SHARED_FOR(&sh, b, 2) {
      const long n0 = b * R;
      const long nr = N - n0 < R ? N - n0 : R;
      if (M == 1) fkb_1_8(xe, xo, H, x, w, bias, y, n0, nr, N, K, 1);
      else if (M == 2) fkb_2_4(xe, xo, H, x, w, bias, y, n0, nr, N, K, 1);
      else fkb_group(xe, xo, H, x, w, bias, y, n0, nr, N, K, M);
    }
  }
  free(buf);
  return 0;
}

/* bf16, any number of rows (prompts; batches of up to 16 rows take the broadcast kernel). Without native
 * bf16 arithmetic the products of many rows are compute-bound float32 FMAs, and the dot-product
 * tiles above (two weight rows against four activation rows, each FMA loading its operands)
 * reach about 45 % of the FMA units' peak. This kernel is a packed outer-product GEMM instead:
 *
 * - each thread owns a contiguous range of 16-column panels of the output (the weight's rows);
 * - for a slice of FK_KC k-values, a panel's 16 weight rows are packed into a float32 buffer
 *   laid out [k][16] (an 8 x 8 transpose of bf16 pairs as 32-bit lanes, then the shift / mask
 *   widening), once for all activation rows of the pass;
 * - a 6 x 16 micro-kernel keeps 12 float32 accumulators in registers and per k loads the two
 *   panel vectors and broadcasts one activation per row: 12 FMAs for 8 loads, no shuffles;
 * - activation rows are widened to float32 per (FK_MC rows x FK_KC) block, partial sums live
 *   in a per-thread float32 buffer of FK_MC x 256 outputs across the k slices, and each output
 *   is rounded to bf16 once at the end (bias added in float32 first).
 *
 * Every output sums its k-values in order (within a slice, then slice after slice), whatever
 * row group or pass its row falls in, so a row gives the same bits alone or in a batch. On the
 * 2-core EPYC with 2 threads: 64 x 2048 by 2048 x 2048 about 190 GFLOPS against 96 for the
 * tiles (the FMA peak measured there is about 230). */
#define FK_NR 16
#define FK_KC 1024 /* k per packed panel slice */
#define FK_MC 96   /* activation rows per pass */
#define FK_SB 16   /* panels per column block: partial sums of FK_MC x 256 outputs per thread */

/* 8 rows of 8 32-bit lanes -> lane j of out[q] = element q of row j */
static inline void fk_tr8(__m256 r[8]) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* p[k][r] = float(w[n0 + r][k0 + k]) for k < kc, r < 16 (rows >= nr are zero) */
static void fk_pack(const uint16_t* w, long K, long n0, long nr, long k0, long kc, float* p) {
  long k = 0;
  if (nr == FK_NR) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (; k + 16 <= kc; k += 16)
      for (int r0 = 0; r0 < 16; r0 += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; j++)
          r[j] = _mm256_castsi256_ps(
              _mm256_loadu_si256((const __m256i*)(w + (n0 + r0 + j) * K + k0 + k)));
        fk_tr8(r); /* r[q]: pair q (k + 2q, k + 2q + 1) of rows r0..r0+7 */
        for (int q = 0; q < 8; q++) {
          __m256i v = _mm256_castps_si256(r[q]);
          _mm256_storeu_ps(p + (k + 2 * q) * FK_NR + r0,
                           _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
          _mm256_storeu_ps(p + (k + 2 * q + 1) * FK_NR + r0,
                           _mm256_castsi256_ps(_mm256_and_si256(v, hi)));
        }
      }
  }
  for (; k < kc; k++)
    for (long r = 0; r < FK_NR; r++)
      p[k * FK_NR + r] = r < nr ? fk_bf16_to_f32(w[(n0 + r) * K + k0 + k]) : 0.0f;
}

#define FK_MK(MR)                                                                              \
  static void fk_mk##MR(const float* x, long ldx, const float* p, long kc, float* c, long ldc) { \
    __m256 a[MR][2];                                                                           \
    for (int i = 0; i < MR; i++) {                                                             \
      a[i][0] = _mm256_loadu_ps(c + i * ldc);                                                  \
      a[i][1] = _mm256_loadu_ps(c + i * ldc + 8);                                              \
    }                                                                                          \
    for (long k = 0; k < kc; k++) {                                                            \
      const __m256 w0 = _mm256_loadu_ps(p + k * FK_NR), w1 = _mm256_loadu_ps(p + k * FK_NR + 8); \
      for (int i = 0; i < MR; i++) {                                                           \
        const __m256 b = _mm256_broadcast_ss(x + i * ldx + k);                                 \
        a[i][0] = _mm256_fmadd_ps(w0, b, a[i][0]);                                             \
        a[i][1] = _mm256_fmadd_ps(w1, b, a[i][1]);                                             \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < MR; i++) {                                                             \
      _mm256_storeu_ps(c + i * ldc, a[i][0]);                                                  \
      _mm256_storeu_ps(c + i * ldc + 8, a[i][1]);                                              \
    }                                                                                          \
  }
FK_MK(1) FK_MK(2) FK_MK(3) FK_MK(4) FK_MK(5) FK_MK(6)
#define FK_MR 6

static void fk_mk(int mr, const float* x, long ldx, const float* p, long kc, float* c, long ldc) {
  switch (mr) {
    case 1: fk_mk1(x, ldx, p, kc, c, ldc); break;
    case 2: fk_mk2(x, ldx, p, kc, c, ldc); break;
    case 3: fk_mk3(x, ldx, p, kc, c, ldc); break;
    case 4: fk_mk4(x, ldx, p, kc, c, ldc); break;
    case 5: fk_mk5(x, ldx, p, kc, c, ldc); break;
    default: fk_mk6(x, ldx, p, kc, c, ldc); break;
  }
}

int fk_linear_bf16_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                        long M, long N, long K) {
  if (M < 1 || N < 1 || K < 1) return -1;
  const long np = (N + FK_NR - 1) / FK_NR;
  int failed = 0;
  fk_share sh;
#pragma omp parallel if (N * K * M >= FK_PARALLEL_MIN)
  {
    const long ldc = FK_SB * FK_NR;
    float* buf = (float*)aligned_alloc(
        64, sizeof(float) * (FK_MC * FK_KC + FK_KC * FK_NR + FK_MC * ldc));
    if (!buf) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    int stop;
#pragma omp atomic read
    stop = failed;
    if (!stop) { /* every thread or none: fk_share_begin has barriers */
      float* xb = buf;
      float* pb = xb + FK_MC * FK_KC;
      float* cb = pb + FK_KC * FK_NR;
      /* items: a column block of sb panels (FK_SB at most, and at least 4 blocks a thread
       * where N allows) x a pass of FK_MC rows, block-major: a thread's own part is whole
       * column blocks, all passes of each */
      const long per = np / (4 * omp_get_num_threads());
      const long sb = per < 1 ? 1 : per > FK_SB ? FK_SB : per, nsb = (np + sb - 1) / sb;
      const long npass = (M + FK_MC - 1) / FK_MC;
      fk_share_begin(&sh, nsb * npass);
      FK_SHARED_FOR(&sh, item, 1) {
        const long m0 = item % npass * FK_MC, s0 = item / npass * sb;
        const long mr = M - m0 < FK_MC ? M - m0 : FK_MC;
        const long sn = np - s0 < sb ? np - s0 : sb;
        memset(cb, 0, sizeof(float) * mr * ldc);
        for (long k0 = 0; k0 < K; k0 += FK_KC) {
          const long kc = K - k0 < FK_KC ? K - k0 : FK_KC;
          for (long i = 0; i < mr; i++) {
            const uint16_t* xr = x + (m0 + i) * K + k0;
            float* xo = xb + i * FK_KC;
#pragma omp simd
            for (long k = 0; k < kc; k++) xo[k] = fk_bf16_to_f32(xr[k]);
          }
          for (long pi = 0; pi < sn; pi++) {
            const long n0 = (s0 + pi) * FK_NR;
            fk_pack(w, K, n0, N - n0 < FK_NR ? N - n0 : FK_NR, k0, kc, pb);
            for (long i0 = 0; i0 < mr; i0 += FK_MR)
              fk_mk((int)(mr - i0 < FK_MR ? mr - i0 : FK_MR), xb + i0 * FK_KC, FK_KC, pb, kc,
                    cb + i0 * ldc + pi * FK_NR, ldc);
          }
        }
        for (long i = 0; i < mr; i++)
          for (long pi = 0; pi < sn; pi++)
            for (long r = 0; r < FK_NR; r++) {
              const long n = (s0 + pi) * FK_NR + r;
              if (n >= N) break;
              float s = cb[i * ldc + pi * FK_NR + r];
              if (bias) s += fk_bf16_to_f32(bias[n]);
              y[(m0 + i) * N + n] = fk_f32_to_bf16(s);
            }
      }
    }
    free(buf);
  }
  return failed ? -1 : 0;
}

/* float32: the same blocking, 16 floats (one cache line) per row and step. */
#define FK_BLOCK_F32(MR, R)                                                                    \
  static void fkf_##MR##_##R(const float* x, const float* w, const float* bias, float* y,      \
                             long n0, long nr, long N, long K, long rs) {                      \
    __m256 acc[MR][R];                                                                         \
    const float* wr[R];                                                                        \
    for (int j = 0; j < R; j++) {                                                              \
      wr[j] = w + (n0 + (j < nr ? j : 0) * rs) * K;                                            \
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
        if (rs == 1) /* the next block's row j */                                              \
          _mm_prefetch((const char*)(wr[j] + R * K + k), _MM_HINT_T0);                         \
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
        y[i * N + n0 + j * rs] = s + (bias ? bias[n0 + j * rs] : 0.0f);                        \
      }                                                                                        \
  }

FK_BLOCK_F32(1, 8)
FK_BLOCK_F32(1, 4) /* FK_STREAMS rows far apart */
FK_BLOCK_F32(2, 4)

int fk_linear_f32(const float* x, const float* w, const float* bias, float* y, long M, long N,
                  long K) {
  if (M < 1 || M > 2 || N < 1 || K < 1) return -1;
  if (M == 1 && N * K >= FK_PARALLEL_MIN) { /* as in fk_linear_bf16: FK_STREAMS streams */
    fk_share sh;
#pragma omp parallel
    {
      const fk_parts q = fk_streams_begin(&sh, N, FK_STREAMS);
      FK_SHARED_STEPS(&sh, N, FK_STREAMS, 8, r, per) fkf_1_4(x, w, bias, y, r, FK_STREAMS, N, K, per);
      for (long j = q.lo + FK_STREAMS * q.per; j < q.hi; j++) fkf_1_8(x, w, bias, y, j, 1, N, K, 1);
    }
    return 0;
  }
  const long R = M == 1 ? 8 : 4;
  const long nblocks = (N + R - 1) / R;
  fk_share sh;
#pragma omp parallel if (N * K >= FK_PARALLEL_MIN)
  {
    fk_share_begin(&sh, nblocks);
    FK_SHARED_FOR(&sh, b, 2) {
      const long n0 = b * R;
      const long nr = N - n0 < R ? N - n0 : R;
      if (M == 1) fkf_1_8(x, w, bias, y, n0, nr, N, K, 1);
      else fkf_2_4(x, w, bias, y, n0, nr, N, K, 1);
    }
  }
  return 0;
}
