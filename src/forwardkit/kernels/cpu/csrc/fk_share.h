/* How forwardkit's native CPU kernels share a loop's items among the OpenMP threads: each
 * thread owns a contiguous part of the items and takes them in order, and a thread that has
 * finished its own part goes on to take the rest of the others' parts (work stealing).
 *
 * A static split (schedule(static)) finishes when the slowest thread does. Cores here are not
 * always equally fast: a core shared with another process or with the host's other guests, an
 * efficiency core beside a performance core. On the 2-core Xeon, 16-row bf16 products of the
 * 1B shape with a busy loop on one core: 464-542 ms a pass over 16 layers with the static
 * split, 370 with schedule(dynamic, 1), 281-288 claiming. With both cores free claims of 4 row
 * groups cost about 0.5 % against the static split (claims of 1, 2-3 %), schedule(dynamic, 1)
 * 2-17 %: a thread reads its own part as one
 * sequential stream, and a claim is an atomic add on a counter no other thread touches until
 * it steals.
 *
 * Which thread computes an item does not change what is computed, so results are the same bits
 * as with any other split.
 *
 *     fk_share sh;                        (before the parallel region: shared)
 *     #pragma omp parallel
 *     {
 *       fk_share_begin(&sh, n);           (every thread of the team, a barrier inside)
 *       FK_SHARED_FOR(&sh, i, chunk) ...  (the items i this thread takes, `chunk` a claim)
 *     }
 *
 * (FK_SHARED_FOR is fk_claim_start() and a loop of fk_share_take(); a claim's c.part says
 * whose part it came from, which fk_streams.h uses.)
 *
 * fk_share_begin starts with a barrier too, so the same fk_share can serve one loop after
 * another in one region. The builder (kernels/cpu/native_build.py) hashes every file a source
 * includes with #include "..." into the library's name, so a change here rebuilds.
 */
#ifndef FK_SHARE_H
#define FK_SHARE_H

#include <omp.h>
#include <stdatomic.h>

#define FK_SHARE_PARTS 64 /* threads past this own no part; they start taking at part t % 64 */

typedef struct {
  _Atomic long next; /* the first item of the part not yet taken */
  long end;          /* the part ends before this item */
} __attribute__((aligned(64))) fk_share_part;

typedef struct {
  fk_share_part part[FK_SHARE_PARTS];
  int parts;
} fk_share;

typedef struct {
  int part, tried; /* the part being taken from, how many parts were found empty */
  long lo, hi;     /* the items taken: [lo, hi) */
} fk_claim;

static inline int fk_share_parts(void) {
  const int nt = omp_get_num_threads();
  return nt < FK_SHARE_PARTS ? nt : FK_SHARE_PARTS;
}

/* Called by every thread of the team: thread t (< fk_share_parts()) owns items [lo, end) (part
 * t), then a barrier. */
static inline void fk_share_begin_part(fk_share* sh, long lo, long end) {
  const int p = fk_share_parts(), t = omp_get_thread_num();
#pragma omp barrier
  if (t < p) {
    sh->part[t].end = end;
    atomic_store_explicit(&sh->part[t].next, lo, memory_order_relaxed);
  }
  if (t == 0) sh->parts = p;
#pragma omp barrier
}

/* Called by every thread of the team: part t of [0, n) for thread t, then a barrier. */
static inline void fk_share_begin(fk_share* sh, long n) {
  const long p = fk_share_parts(), t = omp_get_thread_num();
  fk_share_begin_part(sh, n * t / p, n * (t + 1) / p);
}

static inline fk_claim fk_claim_start(void) {
  fk_claim c;
  c.part = omp_get_thread_num() % fk_share_parts();
  c.tried = 0;
  c.lo = c.hi = 0;
  return c;
}

/* Takes up to `chunk` items into c->lo..c->hi: from the thread's own part while it lasts, then
 * from the next parts in turn. Returns 0 when every part is taken. */
static inline int fk_share_take(fk_share* sh, fk_claim* c, long chunk) {
  while (c->tried < sh->parts) {
    fk_share_part* p = &sh->part[c->part];
    const long g = atomic_fetch_add_explicit(&p->next, chunk, memory_order_relaxed);
    if (g < p->end) {
      c->lo = g;
      c->hi = p->end - g < chunk ? p->end : g + chunk;
      return 1;
    }
    c->part = (c->part + 1) % sh->parts;
    c->tried++;
  }
  return 0;
}

/* The items [c.lo, c.hi) of every claim this thread makes, as `long i`; a statement follows. */
#define FK_SHARED_FOR(sh, i, chunk)                                      \
  for (fk_claim fk_c_ = fk_claim_start(); fk_share_take(sh, &fk_c_, chunk);) \
    for (long i = fk_c_.lo; i < fk_c_.hi; i++)

#endif /* FK_SHARE_H */
