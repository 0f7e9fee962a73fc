/* Paged decode attention on the CPU: one call per layer for every decode request of a step.
 *
 * Inputs (elements of one dtype, bf16 or float32, except the int64 index arrays):
 *   query    [T, Hq, D]  rows of the step's tokens (row stride q_stride, heads contiguous);
 *   k_cache, v_cache     one layer's halves [num_blocks + 1, block_size, Hk, D], contiguous
 *                        (num_slots = (num_blocks + 1) * block_size rows of Hk * D);
 *   rows     [n]         the token row of each decode request;
 *   table    [n, W]      each decode request's block ids (entries past its length unused);
 *   seq_lens [n]         keys each request attends to (its cached prefix plus this token);
 *   out      [T, Hq, D]  written at `rows` only (row stride out_stride); other rows untouched.
 * Optionally first the step's keys/values are stored: key/value [n_write, Hk, D] (row strides
 * key_stride / value_stride) at slots[r] (a negative slot counts from the end, as index_put_
 * wraps it: -1 is the scratch block's last row).
 *
 * Work is split into tasks of (request, run of KV heads); the Hq / Hk query heads that share a
 * KV head are attended together, so each K and V row is read once (and, in bf16, widened once)
 * for the whole group. The softmax is streamed in one pass over the keys (online softmax):
 * keys are taken in chunks of FK_CHUNK; per chunk the task's K rows are widened into a float32
 * buffer (bf16; float32 rows are read where they lie in the cache when the chunk is inside one
 * block, as it always is with blocks of a multiple of FK_CHUNK keys, and copied only when it
 * crosses blocks), each query head's scores computed (four keys at a time, their dot products
 * reduced together), its running maximum updated, its running sum and output accumulator rescaled by
 * exp(old max - new max) when the maximum grew, and then the V rows, widened the same way,
 * weighted by exp(score - max) into the accumulator (two heads' accumulators held in registers
 * over the chunk). Everything is float32; exp is a Cephes-style polynomial (within 1 ulp of
 * exp) that the compiler vectorises; the output is acc / sum, rounded to nearest even for
 * bf16. Results match PyTorch's SDPA to float32 rounding (the summation order differs), not
 * bit for bit.
 *
 * Memory: a task reads each key's row span of its KV heads (adjacent in the cache) in address
 * order (float32 rows read in place instead of copied first: the 1B shape's 16-request decode
 * step, 2 threads, AVX2 build, 0.69-0.71 -> 0.62-0.65 ms a layer inside the engine); a block's
 * keys are adjacent too, so the reads are sequential within a block and the hardware
 * prefetchers follow them (software prefetching of the next chunk measured slower).
 * One run covers all of a request's KV heads (up to FK_MAX_SPAN floats) unless the step is
 * split over threads and has fewer requests than twice the threads: then the heads are split
 * into runs so that every thread gets work. Tasks are spread over the OpenMP threads (the
 * process's runtime, PyTorch's libgomp) only when the step has enough keys to be worth waking
 * a second thread; the K/V write stays on one thread unless it is large (a long prompt in a
 * mixed step). Head sizes 32, 64 and 128 are compiled as constants (unrolled row loops).
 *
 * Every index is checked before anything is written or read: a block id, slot, row or sequence
 * length out of range returns FK_ERR_RANGE and touches nothing (the caller then takes the
 * PyTorch path, which raises its own error).
 *
 * Arguments come as two int64 arrays (layout FK_L_* and FK_S_* below; the caller packs them,
 * one array per call and one per step) and the scale: one foreign call costs a fraction of a
 * microsecond per argument, which at batch 1 matters.
 *
 * Portable GNU C: no intrinsics, vector types as wide as the target's registers. The builder
 * (kernels/cpu/native_attention.py) compiles it once per ISA (-mavx512f ..., -mavx2 -mfma, or
 * the compiler's baseline) with -O3 -fopenmp.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "fk_bf16.h"

#define FK_ATTENTION_ABI_VERSION 2
#define FK_CHUNK 16                       /* keys scored per softmax update */
#define FK_MAX_GROUP_ELEMS (1L << 14)     /* query heads * D floats of a task's state (stack) */
#define FK_MAX_HEAD_SIZE 1024             /* D */
#define FK_MAX_SPAN 1024                  /* floats of a key's row one task reads (stack) */
#define FK_PARALLEL_MIN (1L << 14)        /* score multiply-adds from which all threads work */
#define FK_WRITE_PARALLEL_MIN (1L << 20)  /* bytes of K/V written from which the write is split */

enum { FK_OK = 0, FK_ERR_SHAPE = 1, FK_ERR_RANGE = 2 };

/* the per-layer (per-call) arguments */
enum {
  FK_L_QUERY, FK_L_Q_STRIDE, FK_L_OUT, FK_L_OUT_STRIDE, FK_L_NUM_TOKENS, FK_L_K_CACHE,
  FK_L_V_CACHE, FK_L_NUM_SLOTS, FK_L_BLOCK_SIZE, FK_L_NUM_HEADS, FK_L_NUM_KV_HEADS,
  FK_L_HEAD_SIZE, FK_L_KEY, FK_L_KEY_STRIDE, FK_L_VALUE, FK_L_VALUE_STRIDE, FK_L_COUNT
};
/* the per-step arguments (the decode requests' index arrays, the slot mapping) */
enum { FK_S_ROWS, FK_S_TABLE, FK_S_WIDTH, FK_S_SEQ_LENS, FK_S_N, FK_S_SLOTS, FK_S_N_WRITE, FK_S_COUNT };

int fk_attention_abi_version(void) { return FK_ATTENTION_ABI_VERSION; }
int fk_attention_layer_args(void) { return FK_L_COUNT; }
int fk_attention_step_args(void) { return FK_S_COUNT; }

/* GNU C vector types as wide as the target's registers (AVX-512: 16 floats, AVX: 8, else 4):
 * the compiler emits the target's instructions for them. (A type wider than the registers is
 * split and spilled through the stack: 5x slower on AVX2.) */
#if defined(__AVX512F__)
#define FK_LANES 16
#elif defined(__AVX__)
#define FK_LANES 8
#else
#define FK_LANES 4
#endif
typedef float fk_vec __attribute__((vector_size(FK_LANES * sizeof(float))));
_Static_assert(FK_CHUNK % FK_LANES == 0, "a score chunk is whole vectors");
typedef float fk_v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float fk_v4 __attribute__((vector_size(4 * sizeof(float))));

#define FK_INLINE static inline __attribute__((always_inline))

FK_INLINE fk_vec fk_load(const float* p) {
  fk_vec v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* The lanes summed as a tree of halves, in registers (an `omp simd reduction` ends every dot
 * product with 16 dependent scalar adds through the stack, which dominated the scoring);
 * fk_hsum4 sums four vectors at once into the four lanes of one. */
#if defined(__clang__) || __GNUC__ >= 12
#define FK_SHUFFLE __builtin_shufflevector
#if FK_LANES >= 8
FK_INLINE fk_v8 fk_fold8(fk_vec v) {
#if FK_LANES == 16
  return FK_SHUFFLE(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + FK_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}
#endif

FK_INLINE float fk_hsum(fk_vec v) {
#if FK_LANES >= 8
  const fk_v8 s8 = fk_fold8(v);
  const fk_v4 s4 = FK_SHUFFLE(s8, s8, 0, 1, 2, 3) + FK_SHUFFLE(s8, s8, 4, 5, 6, 7);
#else
  const fk_v4 s4 = v;
#endif
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

FK_INLINE fk_v4 fk_hsum4(fk_vec a, fk_vec b, fk_vec c, fk_vec d) {
#if FK_LANES >= 8
  const fk_v8 a8 = fk_fold8(a), b8 = fk_fold8(b), c8 = fk_fold8(c), d8 = fk_fold8(d);
  /* [a's 4 partial sums | b's], [c's | d's] */
  const fk_v8 ab = FK_SHUFFLE(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                   FK_SHUFFLE(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
  const fk_v8 cd = FK_SHUFFLE(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                   FK_SHUFFLE(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
  /* [a01 a23 c01 c23 b01 b23 d01 d23] */
  const fk_v8 t = FK_SHUFFLE(ab, cd, 0, 2, 8, 10, 4, 6, 12, 14) +
                  FK_SHUFFLE(ab, cd, 1, 3, 9, 11, 5, 7, 13, 15);
  return FK_SHUFFLE(t, t, 0, 4, 2, 6) + FK_SHUFFLE(t, t, 1, 5, 3, 7);
#else
  const fk_v4 t0 = FK_SHUFFLE(a, b, 0, 4, 1, 5) + FK_SHUFFLE(a, b, 2, 6, 3, 7);
  const fk_v4 t1 = FK_SHUFFLE(c, d, 0, 4, 1, 5) + FK_SHUFFLE(c, d, 2, 6, 3, 7);
  return FK_SHUFFLE(t0, t1, 0, 1, 4, 5) + FK_SHUFFLE(t0, t1, 2, 3, 6, 7);
#endif
}
#else
FK_INLINE float fk_hsum(fk_vec v) {
  float s = 0.0f;
  for (int l = 0; l < FK_LANES; l++) s += v[l];
  return s;
}

FK_INLINE fk_v4 fk_hsum4(fk_vec a, fk_vec b, fk_vec c, fk_vec d) {
  const fk_v4 s = {fk_hsum(a), fk_hsum(b), fk_hsum(c), fk_hsum(d)};
  return s;
}
#endif

/* sum a[i] * b[i]: FK_LANES lanes of partial sums, then fk_hsum and the tail. */
FK_INLINE float fk_dot(const float* a, const float* b, long n) {
  fk_vec acc = {0.0f};
  long i = 0;
  for (; i + FK_LANES <= n; i += FK_LANES) acc += fk_load(a + i) * fk_load(b + i);
  float s = fk_hsum(acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* a . b_k (n elements) for the four rows b, b + rs, b + 2 rs, b + 3 rs: four FMA chains sharing
 * the loads of a, reduced together. */
FK_INLINE fk_v4 fk_dot4(const float* a, const float* b, long n, long rs) {
  fk_vec s0 = {0.0f}, s1 = {0.0f}, s2 = {0.0f}, s3 = {0.0f};
  long i = 0;
  for (; i + FK_LANES <= n; i += FK_LANES) {
    const fk_vec x = fk_load(a + i);
    s0 += x * fk_load(b + i);
    s1 += x * fk_load(b + rs + i);
    s2 += x * fk_load(b + 2 * rs + i);
    s3 += x * fk_load(b + 3 * rs + i);
  }
  fk_v4 s = fk_hsum4(s0, s1, s2, s3);
  for (; i < n; i++)
    for (int k = 0; k < 4; k++) s[k] += a[i] * b[k * rs + i];
  return s;
}

/* The sum of FK_CHUNK floats (FK_CHUNK a multiple of FK_LANES). */
FK_INLINE float fk_sum_chunk(const float* p) {
  fk_vec v = fk_load(p);
  for (int i = FK_LANES; i < FK_CHUNK; i += FK_LANES) v += fk_load(p + i);
  return fk_hsum(v);
}

/* exp(x) for the softmax (x <= 0 in practice), vectorisable: x = n ln2 + r with |r| <= ln2/2,
 * a degree-6 polynomial for exp(r), 2^n from the exponent bits; exactly 0 below -87 (where
 * expf is subnormal or 0; -inf included). */
FK_INLINE float fk_exp(float x) {
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float round = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to integer */
  const float n = (xc * 1.44269504088896341f + round) - round;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

FK_INLINE void fk_widen(const uint16_t* src, float* dst, long d) {
#pragma omp simd
  for (long i = 0; i < d; i++) dst[i] = fk_bf16_to_f32(src[i]);
}

typedef struct {
  const char* k_cache;
  const char* v_cache;
  long block_size, hk, g, d, es;
  float scale;
  int bf16;
} fk_layer;

/* Per-thread scratch of fk_attend (for up to FK_MAX_SPAN / D KV heads at a time). */
typedef struct {
  float *q, *acc, *m, *l, *sc, *rowbuf;
} fk_scratch;

/* Cache rows (block * block_size + offset) of keys t0 .. t0 + nc - 1 (blocks from `table`). */
FK_INLINE void fk_offsets(const fk_layer* c, const int64_t* table, long t0, long nc, long* off) {
  long b = t0 / c->block_size, o = t0 % c->block_size;
  for (long j = 0; j < nc; j++) {
    off[j] = table[b] * c->block_size + o;
    if (++o == c->block_size) o = 0, b++;
  }
}

/* The hn heads' rows of keys j < nc (byte offsets `off` into `half`) as float32 into
 * rows[hh][j][:], reading each key's heads in address order. */
FK_INLINE void fk_gather(const char* half, const long* off, long nc, long hn, long D, int bf16,
                         float* rows) {
  for (long j = 0; j < nc; j++)
    for (long hh = 0; hh < hn; hh++) {
      float* dst = rows + (hh * FK_CHUNK + j) * D;
      if (bf16)
        fk_widen((const uint16_t*)(half + off[j]) + hh * D, dst, D);
      else
        memcpy(dst, (const float*)(half + off[j]) + hh * D, (size_t)D * sizeof(float));
    }
}

/* acc[g][:] += sum_j p[g][j] * v_j[:] for the G heads of a chunk (p = sc[g * FK_CHUNK + j];
 * value row j at vrows + j * rs).
 * Blocks of FK_VB vectors of two heads stay in registers over the chunk's keys (8 independent
 * FMA chains, each value row loaded once for both); what is left of a row (D not a multiple of
 * the block) goes through memory. */
#define FK_VB 4
FK_INLINE void fk_accumulate(float* acc, const float* sc, const float* vrows, long nc, long G,
                             long D, long rs) {
  const long blk = FK_VB * FK_LANES, dfast = D / blk * blk;
  long g = 0;
  for (; g + 2 <= G; g += 2) {
    const float *p0 = sc + g * FK_CHUNK, *p1 = p0 + FK_CHUNK;
    for (long d0 = 0; d0 < dfast; d0 += blk) {
      float *a0 = acc + g * D + d0, *a1 = a0 + D;
      fk_vec r0[FK_VB], r1[FK_VB];
      for (int u = 0; u < FK_VB; u++) r0[u] = fk_load(a0 + u * FK_LANES);
      for (int u = 0; u < FK_VB; u++) r1[u] = fk_load(a1 + u * FK_LANES);
      for (long j = 0; j < nc; j++) {
        const float *v = vrows + j * rs + d0, w0 = p0[j], w1 = p1[j];
        for (int u = 0; u < FK_VB; u++) {
          const fk_vec x = fk_load(v + u * FK_LANES);
          r0[u] += w0 * x;
          r1[u] += w1 * x;
        }
      }
      memcpy(a0, r0, sizeof r0);
      memcpy(a1, r1, sizeof r1);
    }
  }
  for (; g < G; g++) {
    const float* p0 = sc + g * FK_CHUNK;
    for (long d0 = 0; d0 < dfast; d0 += blk) {
      float* a0 = acc + g * D + d0;
      fk_vec r0[FK_VB];
      for (int u = 0; u < FK_VB; u++) r0[u] = fk_load(a0 + u * FK_LANES);
      for (long j = 0; j < nc; j++) {
        const float *v = vrows + j * rs + d0, w0 = p0[j];
        for (int u = 0; u < FK_VB; u++) r0[u] += w0 * fk_load(v + u * FK_LANES);
      }
      memcpy(a0, r0, sizeof r0);
    }
  }
  if (dfast < D)
    for (long j = 0; j < nc; j++)
      for (g = 0; g < G; g++) {
        const float w = sc[g * FK_CHUNK + j];
        float* a = acc + g * D;
        const float* v = vrows + j * rs;
#pragma omp simd
        for (long i = dfast; i < D; i++) a[i] += w * v[i];
      }
}

/* Attention of the query heads of `qrow` that share KV heads h0 .. h0 + hn - 1 over the first
 * `len` keys of the blocks `table`, into `orow`. Per chunk the K rows of the heads, then their
 * V rows, are widened (bf16) or copied (float32) into `rowbuf` [hn][FK_CHUNK][D], reading each
 * key's span of hn heads in address order: whole cache lines, consecutive within a block, which
 * the hardware prefetchers follow (software prefetches of the next chunk were slower). */
FK_INLINE void fk_attend_d(const fk_layer* c, const char* qrow, char* orow, const int64_t* table,
                           long len, long h0, long hn, const fk_scratch* w, const long D) {
  const long G = c->g, es = c->es, R = hn * G; /* R query heads */
  const long stride = c->hk * D * es; /* bytes per key in a cache half */
  const int bf16 = c->bf16;
  float *q = w->q, *acc = w->acc, *m = w->m, *l = w->l, *sc = w->sc, *rowbuf = w->rowbuf;
  const char* qsrc = qrow + h0 * G * D * es;
  if (bf16)
    fk_widen((const uint16_t*)qsrc, q, R * D);
  else
    memcpy(q, qsrc, (size_t)(R * D) * sizeof(float));
  for (long r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
  memset(acc, 0, (size_t)(R * D) * sizeof(float));
  long off[FK_CHUNK]; /* byte offset of each key's row (KV head h0) in a cache half */
  for (long t0 = 0; t0 < len; t0 += FK_CHUNK) {
    const long nc = len - t0 < FK_CHUNK ? len - t0 : FK_CHUNK;
    fk_offsets(c, table, t0, nc, off);
    for (long j = 0; j < nc; j++) off[j] = off[j] * stride + h0 * D * es;
    /* float32 keys of one block are read where they are (key j of head hh at row j * Hk * D +
     * hh * D of the block); bf16 ones, or a chunk across blocks, are gathered into rowbuf
     * [hn][FK_CHUNK][D] first */
    const int direct = !bf16 && t0 % c->block_size + nc <= c->block_size;
    const long rs = direct ? c->hk * D : D, hs = direct ? D : FK_CHUNK * D;
    const float* krows = direct ? (const float*)(c->k_cache + off[0]) : rowbuf;
    if (!direct) fk_gather(c->k_cache, off, nc, hn, D, bf16, rowbuf);
    /* scores of the chunk for every query head; -inf past the last key, so the softmax loops
     * below always run over a whole chunk (exp gives exactly 0 there) */
    for (long hh = 0; hh < hn; hh++)
      for (long g = 0; g < G; g++) {
        const long r = hh * G + g;
        float* sr = sc + r * FK_CHUNK;
        const float* kr = krows + hh * hs;
        long j = 0;
        for (; j + 4 <= nc; j += 4) {
          const fk_v4 s4 = fk_dot4(q + r * D, kr + j * rs, D, rs) * c->scale;
          memcpy(sr + j, &s4, sizeof s4);
        }
        for (; j < nc; j++) sr[j] = fk_dot(q + r * D, kr + j * rs, D) * c->scale;
        for (long j = nc; j < FK_CHUNK; j++) sr[j] = -INFINITY;
      }
    /* online softmax: new running max, weights of the chunk, rescale what was summed so far */
    for (long r = 0; r < R; r++) {
      float* sr = sc + r * FK_CHUNK;
      float mx = m[r];
      for (long j = 0; j < FK_CHUNK; j++) mx = sr[j] > mx ? sr[j] : mx;
#pragma omp simd
      for (long j = 0; j < FK_CHUNK; j++) sr[j] = fk_exp(sr[j] - mx);
      const float sum = fk_sum_chunk(sr);
      if (mx > m[r] && m[r] != -INFINITY) {
        const float corr = fk_exp(m[r] - mx);
        float* a = acc + r * D;
        l[r] *= corr;
#pragma omp simd
        for (long i = 0; i < D; i++) a[i] *= corr;
      }
      l[r] += sum;
      m[r] = mx;
    }
    /* the chunk's values, each row read (and widened) once for its G query heads */
    const float* vrows = direct ? (const float*)(c->v_cache + off[0]) : rowbuf;
    if (!direct) fk_gather(c->v_cache, off, nc, hn, D, bf16, rowbuf);
    for (long hh = 0; hh < hn; hh++)
      fk_accumulate(acc + hh * G * D, sc + hh * G * FK_CHUNK, vrows + hh * hs, nc, G, D, rs);
  }
  char* dst = orow + h0 * G * D * es;
  for (long r = 0; r < R; r++) {
    const float inv = 1.0f / l[r];
    const float* a = acc + r * D;
    if (bf16) {
      uint16_t* d16 = (uint16_t*)dst + r * D;
#pragma omp simd
      for (long i = 0; i < D; i++) d16[i] = fk_f32_to_bf16(a[i] * inv);
    } else {
      float* d32 = (float*)dst + r * D;
#pragma omp simd
      for (long i = 0; i < D; i++) d32[i] = a[i] * inv;
    }
  }
}

/* fk_attend_d for common head sizes as constants (the compiler unrolls the row loops
 * and drops their tails), any other at run time. */
static void fk_attend(const fk_layer* c, const char* qrow, char* orow, const int64_t* table,
                      long len, long h0, long hn, const fk_scratch* w) {
  switch (c->d) {
    case 32: fk_attend_d(c, qrow, orow, table, len, h0, hn, w, 32); break;
    case 64: fk_attend_d(c, qrow, orow, table, len, h0, hn, w, 64); break;
    case 128: fk_attend_d(c, qrow, orow, table, len, h0, hn, w, 128); break;
    default: fk_attend_d(c, qrow, orow, table, len, h0, hn, w, c->d); break;
  }
}

static int fk_run(const int64_t* L, const int64_t* S, float scale, int bf16) {
  const long T = L[FK_L_NUM_TOKENS], num_slots = L[FK_L_NUM_SLOTS], bs = L[FK_L_BLOCK_SIZE];
  const long hq = L[FK_L_NUM_HEADS], hk = L[FK_L_NUM_KV_HEADS], d = L[FK_L_HEAD_SIZE];
  const long width = S[FK_S_WIDTH], n = S[FK_S_N], n_write = S[FK_S_N_WRITE];
  const int64_t* rows = (const int64_t*)(intptr_t)S[FK_S_ROWS];
  const int64_t* table = (const int64_t*)(intptr_t)S[FK_S_TABLE];
  const int64_t* seq_lens = (const int64_t*)(intptr_t)S[FK_S_SEQ_LENS];
  const int64_t* slots = (const int64_t*)(intptr_t)S[FK_S_SLOTS];
  if (hk <= 0 || d <= 0 || d > FK_MAX_HEAD_SIZE || hq % hk || bs <= 0 || n < 0 || n_write < 0 ||
      width < 0 || (n_write > 0 && (!slots || !L[FK_L_KEY] || !L[FK_L_VALUE])))
    return FK_ERR_SHAPE;
  const long G = hq / hk;
  /* KV heads one task attends: as many as fit FK_MAX_SPAN floats of a key's row */
  const long span_heads = FK_MAX_SPAN / d < 1 ? 1 : (FK_MAX_SPAN / d < hk ? FK_MAX_SPAN / d : hk);
  if (span_heads * G * d > FK_MAX_GROUP_ELEMS) return FK_ERR_SHAPE;
  /* every index is checked before anything is touched */
  long total = 0;
  for (long i = 0; i < n; i++) {
    const long len = seq_lens[i];
    if (rows[i] < 0 || rows[i] >= T || len < 1 || len > width * bs) return FK_ERR_RANGE;
    const int64_t* bt = table + i * width;
    for (long b = 0; b < (len + bs - 1) / bs; b++)
      if (bt[b] < 0 || (bt[b] + 1) * bs > num_slots) return FK_ERR_RANGE;
    total += len;
  }
  for (long r = 0; r < n_write; r++) {
    const long s = slots[r] < 0 ? slots[r] + num_slots : slots[r];
    if (s < 0 || s >= num_slots) return FK_ERR_RANGE;
  }
  const long es = bf16 ? 2 : 4, row_bytes = hk * d * es;
  char* k_cache = (char*)(intptr_t)L[FK_L_K_CACHE];
  char* v_cache = (char*)(intptr_t)L[FK_L_V_CACHE];
  /* the step's keys and values first: the decode tokens attend to their own */
  const char* key = (const char*)(intptr_t)L[FK_L_KEY];
  const char* value = (const char*)(intptr_t)L[FK_L_VALUE];
  const long key_stride = L[FK_L_KEY_STRIDE] * es, value_stride = L[FK_L_VALUE_STRIDE] * es;
#pragma omp parallel for schedule(static) if (row_bytes * n_write >= FK_WRITE_PARALLEL_MIN)
  for (long r = 0; r < n_write; r++) {
    const long s = slots[r] < 0 ? slots[r] + num_slots : slots[r];
    memcpy(k_cache + s * row_bytes, key + r * key_stride, (size_t)row_bytes);
    memcpy(v_cache + s * row_bytes, value + r * value_stride, (size_t)row_bytes);
  }
  const fk_layer layer = {k_cache, v_cache, bs, hk, G, d, es, scale, bf16};
  const char* query = (const char*)(intptr_t)L[FK_L_QUERY];
  char* out = (char*)(intptr_t)L[FK_L_OUT];
  const long q_stride = L[FK_L_Q_STRIDE] * es, out_stride = L[FK_L_OUT_STRIDE] * es;
  /* Tasks: (request, run of KV heads). One run per request (all its heads, up to span_heads)
   * reads each key's row span in address order; when the step is split over threads and has
   * few requests, the heads are split further so every thread gets work. */
  const int parallel = total * hq * d >= FK_PARALLEL_MIN;
  long runs = (hk + span_heads - 1) / span_heads;
  if (parallel) {
    const long want = (2L * omp_get_max_threads() + n - 1) / (n > 0 ? n : 1);
    runs = want > runs ? (want < hk ? want : hk) : runs;
  }
  const long tasks = n * runs;
  const long max_hn = (hk + runs - 1) / runs;
#pragma omp parallel if (parallel && tasks > 1)
  {
    float q[max_hn * G * d], acc[max_hn * G * d], m[max_hn * G], l[max_hn * G];
    float sc[max_hn * G * FK_CHUNK], buf[max_hn * FK_CHUNK * d];
    const fk_scratch scratch = {q, acc, m, l, sc, buf};
#pragma omp for schedule(dynamic, 1)
    for (long t = 0; t < tasks; t++) {
      const long i = t / runs, run = t % runs;
      const long h0 = run * hk / runs, h1 = (run + 1) * hk / runs;
      fk_attend(&layer, query + rows[i] * q_stride, out + rows[i] * out_stride, table + i * width,
                seq_lens[i], h0, h1 - h0, &scratch);
    }
  }
  return FK_OK;
}

int fk_decode_attention_bf16(const int64_t* layer, const int64_t* step, float scale) {
  return fk_run(layer, step, scale, 1);
}

int fk_decode_attention_f32(const int64_t* layer, const int64_t* step, float scale) {
  return fk_run(layer, step, scale, 0);
}
