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
 * region.
 *
 * The builder (kernels/cpu/native_build.py) hashes every file a source includes with
 * #include "..." into the library's name, so a change here rebuilds.
 */
#ifndef FK_STREAMS_H
#define FK_STREAMS_H

#include <omp.h>

typedef struct {
  long lo, hi, per;
} fk_parts;

static inline fk_parts fk_thread_parts(long N, long S) {
  const long nt = omp_get_num_threads(), t = omp_get_thread_num();
  fk_parts p;
  p.lo = N * t / nt;
  p.hi = N * (t + 1) / nt;
  p.per = (p.hi - p.lo) / S;
  return p;
}

#endif /* FK_STREAMS_H */
