"""Back large CPU weights with transparent huge pages, and zero large buffers lazily (Linux).

A decode step streams every weight once. On 4 KiB pages that stream takes a TLB miss every
4 KiB and the hardware prefetchers stop at each page boundary; one core here reads about
17 GB/s from 4 KiB pages and 28 GB/s from 2 MiB pages. Linux gives huge pages to anonymous
memory that asks for them (``madvise``) when ``/sys/kernel/mm/transparent_hugepage/enabled``
is ``madvise`` or ``always``.

:func:`advise` marks a tensor's memory before it is first written (the page faults then
allocate huge pages directly, which is also faster than faulting 4 KiB pages);
:func:`collapse` moves memory already written onto huge pages (``MADV_COLLAPSE``, Linux 6.1+).
Only the 2 MiB-aligned interior of a tensor can be huge; both are best-effort and return the
bytes covered (0 when the system declines).

The loader advises every weight of a model with fast CPU paths after building the model and
before writing its values, so the weights fault in on huge pages as they are written: on the
2-core EPYC writing 2.5 GB took 0.25-1.4 s there against 1.1-4.7 s on 4 KiB pages. Quantizing
on load advises the packed blocks it allocates, and the GGUF loader the bytes it copies out of
the file. What was written before it could be advised (memory the allocator hands back after a
staging weight was freed is on 4 KiB pages already) is moved afterwards: collapsing costs the
kernel about 1 s per GiB of CPU time and stalls the steps that run beside it (the decode steps
of a 1 B bf16 model took 1-2.6 s instead of 0.12 while its 2.5 GB moved). The loader queues
the weights (a :class:`DeferredCollapse`, held by the model's ``CpuLinearRouter``) and the
model runner starts the move after its first real step (:meth:`DeferredCollapse.start`);
memory already on huge pages is skipped at once.

:func:`zero_` zeroes a large CPU tensor without touching its pages: the page-aligned interior
is handed back to the kernel (``MADV_DONTNEED``), which maps zero pages in on first touch. A
512 MiB KV cache is then "allocated" in microseconds instead of ~0.5-1 s of page faults, and
memory a short run never uses is never committed.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import mmap
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch

from forwardkit.logger import init_logger

__all__ = ["HUGE_PAGE", "DeferredCollapse", "advise", "collapse", "collapse_in_background",
           "wait_for_moves", "zero_"]

logger = init_logger(__name__)

HUGE_PAGE = 2 << 20
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
# Below this a plain memset is as fast as the system call and its bookkeeping.
_LAZY_ZERO_MIN_BYTES = 1 << 20


@functools.lru_cache(maxsize=1)
def _libc_madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=1)
def _madvise() -> Callable[..., int] | None:
    """``madvise`` where transparent huge pages are on (``madvise`` or ``always``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            if "[never]" in f.read():
                return None
    except OSError:
        return None
    return _libc_madvise()


def _interior(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    return lo, hi


def _apply(t: torch.Tensor, advice: int) -> int:
    fn = _madvise()
    if fn is None or t.device.type != "cpu" or t.is_mkldnn:
        return 0
    lo, hi = _interior(t)
    if hi <= lo:
        return 0
    return hi - lo if fn(lo, hi - lo, advice) == 0 else 0


def advise(t: torch.Tensor) -> int:
    """Ask for huge pages for ``t``'s storage (takes effect for pages not yet touched)."""
    return _apply(t, _MADV_HUGEPAGE)


def collapse(t: torch.Tensor) -> int:
    """Move ``t``'s storage, already written, onto huge pages now."""
    return _apply(t, _MADV_COLLAPSE)


# Memory is moved in slices of this size, so a stop request waits for one slice at most.
_COLLAPSE_STEP = 64 << 20
_stop = threading.Event()
_workers: list[threading.Thread] = []


def _stop_workers() -> None:
    """At interpreter exit: stop the collapse threads between two slices and wait for them. A
    daemon thread still inside a system call at finalisation would be torn down when it
    returns, which aborts the process if C++ frames are on its stack."""
    _stop.set()
    for thread in _workers:
        thread.join(timeout=10)


atexit.register(_stop_workers)


def wait_for_moves(timeout: float | None = None) -> bool:
    """Wait until every background move started so far is done (at most ``timeout`` seconds in
    all); True when none is left running, else False with a warning that what follows runs
    beside them. A benchmark calls it before timing: a move still running takes a core and
    memory bandwidth from what is timed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in list(_workers):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    _workers[:] = [t for t in _workers if t.is_alive()]
    if _workers:
        logger.warning("the move of the weights onto huge pages still runs after %s s; what "
                       "follows runs beside it", timeout)
    return not _workers


def collapse_in_background(tensors: Iterable[torch.Tensor]) -> threading.Thread | None:
    """:func:`collapse` each tensor on a daemon thread and return it (None when there is
    nothing to do). The system call releases the GIL and the kernel keeps the memory readable
    and writable while it moves, so other work goes on meanwhile. The addresses are worked
    out here; the thread runs only ``madvise`` (through ``ctypes``, no torch frames) on 64 MiB
    slices and stops early when the interpreter exits."""
    fn = _madvise()
    todo = [t for t in tensors if t.device.type == "cpu" and not t.is_mkldnn
            and t.untyped_storage().nbytes() >= HUGE_PAGE]
    spans = [span for span in map(_interior, todo) if span[1] > span[0]]
    if not spans or fn is None:
        return None

    def run(keep: list[torch.Tensor] = todo) -> None:  # keep: the memory stays mapped meanwhile
        for lo, hi in spans:
            for start in range(lo, hi, _COLLAPSE_STEP):
                if _stop.is_set():
                    return
                fn(start, min(_COLLAPSE_STEP, hi - start), _MADV_COLLAPSE)

    _workers[:] = [t for t in _workers if t.is_alive()]
    thread = threading.Thread(target=run, name="forwardkit-hugepages", daemon=True)
    _workers.append(thread)
    thread.start()
    return thread


class DeferredCollapse:
    """Tensors queued for huge pages (weakly: a model dropped before it ran frees its
    weights), moved by :meth:`start`. One per model: the loader queues its weights
    (``CpuLinearRouter.huge_pages``) and the runner starts the move after its first step."""

    def __init__(self) -> None:
        self._pending: list[weakref.ref[torch.Tensor]] = []

    def defer(self, tensors: Iterable[torch.Tensor]) -> None:
        """Queue ``tensors`` for :meth:`start`."""
        self._pending.extend(weakref.ref(t) for t in tensors)

    def _live(self) -> list[torch.Tensor]:
        return [t for t in (ref() for ref in self._pending) if t is not None]

    def pending_bytes(self) -> int:
        """Bytes of live storage queued and not yet handed to a collapse thread."""
        return sum(t.untyped_storage().nbytes() for t in self._live())

    def start(self) -> threading.Thread | None:
        """Move every queued tensor still alive onto huge pages on a background thread (see
        the module doc); returns it, or None when there is nothing to move. Cheap when the
        queue is empty (every step after the first calls it)."""
        if not self._pending:
            return None
        todo = self._live()
        self._pending.clear()
        return collapse_in_background(todo)


def zero_(t: torch.Tensor) -> torch.Tensor:
    """Zero ``t`` in place and return it. For a contiguous CPU tensor of 1 MiB or more the
    page-aligned interior of its memory is given back to the kernel (``MADV_DONTNEED``: the
    next touch maps a zeroed page) and only the partial pages at the two ends are written;
    anything else, or a system that declines, gets ``t.zero_()``."""
    fn = _libc_madvise()
    nbytes = t.numel() * t.element_size()
    if (fn is None or t.device.type != "cpu" or not t.is_contiguous() or t.is_mkldnn
            or nbytes < _LAZY_ZERO_MIN_BYTES):
        return t.zero_()
    start = t.data_ptr()
    lo = -(-start // _PAGE) * _PAGE
    hi = (start + nbytes) // _PAGE * _PAGE
    if hi <= lo or fn(lo, hi - lo, _MADV_DONTNEED) != 0:
        return t.zero_()
    raw = t.view(-1).view(torch.uint8)
    raw[:lo - start].zero_()
    raw[hi - start:].zero_()
    return t
