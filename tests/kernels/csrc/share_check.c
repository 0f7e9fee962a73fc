/* Test harness for fk_share.h / fk_streams.h (tests/kernels/test_work_sharing.py): runs their
 * claim loops on `threads` OpenMP threads and records, per item, which thread took it and how
 * many times. With `wait_first`, every thread but 0 waits until thread 0 has found nothing
 * left, so thread 0 must have taken the other threads' parts too (a stand-in for a slow core). */
#include <omp.h>
#include <stdatomic.h>

#include "fk_streams.h"

static void wait_for(atomic_int* flag) {
  while (!atomic_load_explicit(flag, memory_order_acquire)) {
  }
}

/* Items [0, n) shared in claims of `chunk`; returns the team size. */
int fk_share_check(long n, long chunk, int threads, int wait_first, int* owner, int* count) {
  fk_share sh;
  atomic_int done0 = 0;
  int team = 0;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    fk_share_begin(&sh, n);
    if (wait_first && t != 0) wait_for(&done0);
    FK_SHARED_FOR(&sh, i, chunk) {
      owner[i] = t;
      __atomic_fetch_add(&count[i], 1, __ATOMIC_RELAXED);
    }
    if (t == 0) {
      team = omp_get_num_threads();
      atomic_store_explicit(&done0, 1, memory_order_release);
    }
  }
  return team;
}

/* One sequence's decode layout (fk_streams.h): rows [0, N) in S streams a part, the steps
 * shared, each part's last rows by its owner; records the owner of every row. Returns the
 * team size. */
int fk_share_streams_check(long N, long S, long chunk, int threads, int wait_first, int* owner,
                           int* count) {
  fk_share sh;
  atomic_int done0 = 0;
  int team = 0;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const fk_parts q = fk_streams_begin(&sh, N, S);
    if (wait_first && t != 0) wait_for(&done0);
    FK_SHARED_STEPS(&sh, N, S, chunk, r, per)
      for (long s = 0; s < S; s++) {
        owner[r + s * per] = t;
        __atomic_fetch_add(&count[r + s * per], 1, __ATOMIC_RELAXED);
      }
    for (long j = q.lo + S * q.per; j < q.hi; j++) { /* the part's last rows: its owner's */
      owner[j] = t;
      __atomic_fetch_add(&count[j], 1, __ATOMIC_RELAXED);
    }
    if (t == 0) {
      team = omp_get_num_threads();
      atomic_store_explicit(&done0, 1, memory_order_release);
    }
  }
  return team;
}
