/* How one sequence's decode splits a weight's rows over the OpenMP threads, for forwardkit's
 * native CPU kernels (both linear_few_rows builds and quant_linear.c).
 *
 * A decode product with one activation row reads every weight row once, so it runs at the
 * speed the weight streams from memory. Each thread takes a contiguous share [lo, hi) of the
 * rows and splits it into S contiguous parts of `per` rows; the kernel takes row i of every
 * part together (rows lo + s * per + i), so a thread reads S long sequential streams that the
 * hardware prefetchers follow. S adjacent rows read side by side are S short streams that
 * restart at every row, which they follow badly (on the 2-core EPYC, 2 threads: bf16 40 -> 58
 * GB/s with AVX-512, q4_0 32 -> 35, q8_0 42-50 -> 54-56; 8 parts were slower than 4). The
 * rows from lo + S * per to hi are left to the caller, one at a time. Call inside a parallel
 * region. Shared out with fk_share.h (fk_streams_begin, FK_SHARED_STEPS), a thread that
 * finishes its own part's steps goes on with the next steps of another's; each part's last
 * rows stay with its owner:
 *
 *     const fk_parts q = fk_streams_begin(&sh, N, S);
 *     FK_SHARED_STEPS(&sh, N, S, 8, r, per) kernel(rows r, r + per, ...);
 *     for (long j = q.lo + S * q.per; j < q.hi; j++) kernel(row j);
 *
 * The builder (kernels/cpu/native_build.py) hashes every file a source includes with
 * #include "..." into the library's name, so a change here rebuilds.
 */
#ifndef FK_STREAMS_H
#define FK_STREAMS_H

#include <omp.h>

#include "fk_share.h"

typedef struct {
  long lo, hi, per;
} fk_parts;

/* Part v of nparts: rows [lo, hi), S parts of `per` rows and the rest. */
static inline fk_parts fk_part_streams(long N, long S, long v, long nparts) {
  fk_parts p;
  p.lo = N * v / nparts;
  p.hi = N * (v + 1) / nparts;
  p.per = (p.hi - p.lo) / S;
  return p;
}

static inline fk_parts fk_thread_parts(long N, long S) {
  return fk_part_streams(N, S, omp_get_thread_num(), omp_get_num_threads());
}

/* Shares one sequence's decode out with fk_share.h (every thread of the team calls it; a
 * barrier inside): the calling thread's part (one a thread, at most FK_SHARE_PARTS; a thread
 * past them owns none and only takes from the others), whose steps i go into `sh`. */
static inline fk_parts fk_streams_begin(fk_share* sh, long N, long S) {
  const int t = omp_get_thread_num(), p = fk_share_parts();
  fk_parts own = {0, 0, 0};
  if (t < p) own = fk_part_streams(N, S, t, p);
  fk_share_begin_part(sh, 0, own.per);
  return own;
}

/* The steps this thread takes after fk_streams_begin, `chunk` a claim: for each, `long r` the
 * step's row in the first stream of its part and `long per` the part's stream length (its
 * rows r, r + per, ..., r + (S - 1) * per); a statement follows. */
#define FK_SHARED_STEPS(sh, N, S, chunk, r, per)                                           \
  for (fk_claim fk_c_ = fk_claim_start(); fk_share_take(sh, &fk_c_, chunk);)             \
    for (long fk_i_ = fk_c_.lo, per = fk_part_streams(N, S, fk_c_.part, (sh)->parts).per, \
              r = fk_part_streams(N, S, fk_c_.part, (sh)->parts).lo + fk_c_.lo;           \
         fk_i_ < fk_c_.hi; fk_i_++, r++)

#endif /* FK_STREAMS_H */
