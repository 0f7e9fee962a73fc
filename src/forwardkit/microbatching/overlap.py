"""Dual-batch overlap (DBO): run a step's micro-batches on threads that take turns.

Behaviour follows vLLM 0.14.0's ``vllm.v1.worker.ubatching`` hand-off protocol, on
``contextvars`` instead of a process-global forward context:

* :func:`run_ubatches` runs one callable per micro-batch, each on its own thread (micro-batch 0
  on the caller's), each under its own :class:`~forwardkit.forward_context.ForwardContext`.
  Exactly one micro-batch computes at a time: micro-batch 0 starts, and each
  :func:`dbo_yield` hands the turn to the next micro-batch that has not finished (0 -> 1 -> 0
  ...), then waits for the turn to come back. A micro-batch that finishes passes the turn on.
* Model code calls the ``dbo_*`` helpers unconditionally; outside a micro-batch thread they
  are no-ops (:func:`dbo_enabled` is False, :func:`dbo_current_ubatch_id` is 0).
* A layer that starts a collective asynchronously registers its wait as a *receive hook*
  (:func:`dbo_register_recv_hook`, attached to the next micro-batch, as in vLLM), yields so the
  sibling computes while the collective is in flight, and finishes the wait on resume. The
  next micro-batch runs a pending hook when it calls :func:`dbo_maybe_run_recv_hook` or
  finishes; hooks must therefore be idempotent (a second wait returns at once).

Failure semantics (stronger than vLLM's, where a step hangs when one micro-batch raises while
its sibling waits at a yield): the first exception in any micro-batch aborts the step. Every
sibling parked at a yield (or not yet started) is woken and unwound with an internal
:class:`UBatchAborted`; every pending receive hook is run (errors logged, not raised) so no
collective is left in flight; all threads are joined; then the first exception is re-raised
on the caller. An exception raised by the caller's own thread is treated the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch

from forwardkit.forward_context import ForwardContext, override_forward_context
from forwardkit.logger import init_logger

__all__ = [
    "UBatchAborted",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_yield",
    "run_ubatches",
    "set_ubatch_event_hook",
]

logger = init_logger(__name__)
_T = TypeVar("_T")


class UBatchAborted(RuntimeError):
    """Raised inside a micro-batch whose sibling failed: unwinds it without a second error."""


class _Run:
    """Shared state of one micro-batched step: whose turn it is, who finished, the first error."""

    def __init__(self, num_ubatches: int) -> None:
        self.n = num_ubatches
        self.cond = threading.Condition()
        self.turn = 0
        self.finished = [False] * num_ubatches
        self.error: BaseException | None = None
        self.hooks: list[Callable[[], object] | None] = [None] * num_ubatches

    # All methods below are called with ``cond`` held.
    def _next_unfinished(self, after: int) -> int | None:
        for k in range(1, self.n + 1):
            j = (after + k) % self.n
            if not self.finished[j]:
                return j
        return None

    def _wait_turn(self, ubatch_id: int) -> None:
        while self.turn != ubatch_id and self.error is None:
            self.cond.wait()
        if self.error is not None:
            raise UBatchAborted(f"micro-batch {ubatch_id} stopped: a sibling micro-batch failed")

    def yield_turn(self, ubatch_id: int) -> None:
        with self.cond:
            if self.error is not None:
                raise UBatchAborted(f"micro-batch {ubatch_id} stopped: a sibling micro-batch failed")
            nxt = self._next_unfinished(ubatch_id)
            if nxt is None or nxt == ubatch_id:
                return  # every sibling finished: keep computing
            self.turn = nxt
            self.cond.notify_all()
            self._wait_turn(ubatch_id)

    def start(self, ubatch_id: int) -> None:
        with self.cond:
            self._wait_turn(ubatch_id)

    def finish(self, ubatch_id: int, error: BaseException | None) -> None:
        with self.cond:
            self.finished[ubatch_id] = True
            if error is not None and not isinstance(error, UBatchAborted) and self.error is None:
                self.error = error
            nxt = self._next_unfinished(ubatch_id)
            if nxt is not None:
                self.turn = nxt
            self.cond.notify_all()

    def abort(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()


class _UBatchState:
    __slots__ = ("run", "ubatch_id")

    def __init__(self, run: _Run, ubatch_id: int) -> None:
        self.run = run
        self.ubatch_id = ubatch_id


# The calling thread's micro-batch (None outside micro-batch threads). A ContextVar: each
# micro-batch runs in its own copy of the caller's context.
_UBATCH: contextvars.ContextVar[_UBatchState | None] = contextvars.ContextVar(
    "forwardkit_ubatch", default=None)

# Test / profiling hook: called as ``hook(ubatch_id, event)`` at each hand-off.
_event_hook: Callable[[int, str], None] | None = None


def set_ubatch_event_hook(hook: Callable[[int, str], None] | None) -> Callable[[int, str], None] | None:
    """Install ``hook(ubatch_id, event)`` (events ``"start"``, ``"yield"``, ``"resume"``,
    ``"end"``), called on the micro-batch's thread; None removes it. Returns the previous hook."""
    global _event_hook
    previous, _event_hook = _event_hook, hook
    return previous


def _event(ubatch_id: int, name: str) -> None:
    hook = _event_hook
    if hook is not None:
        hook(ubatch_id, name)


def dbo_enabled() -> bool:
    """Whether the caller runs inside a micro-batch of a micro-batched (DBO) step."""
    return _UBATCH.get() is not None


def dbo_current_ubatch_id() -> int:
    """The caller's micro-batch index; 0 outside micro-batch threads."""
    state = _UBATCH.get()
    return 0 if state is None else state.ubatch_id


def dbo_yield() -> None:
    """Hand the turn to the next unfinished micro-batch and wait until it comes back.

    A no-op outside micro-batch threads, or when every sibling has finished. Raises
    :class:`UBatchAborted` when a sibling failed meanwhile.
    """
    state = _UBATCH.get()
    if state is None:
        return
    _event(state.ubatch_id, "yield")
    state.run.yield_turn(state.ubatch_id)
    _event(state.ubatch_id, "resume")


def dbo_register_recv_hook(hook: Callable[[], object]) -> None:
    """Attach ``hook`` to the next micro-batch: it runs when that one calls
    :func:`dbo_maybe_run_recv_hook` or finishes (once). A no-op outside micro-batch threads.

    The hook must be idempotent: the registering micro-batch normally finishes the same wait
    itself on resume.
    """
    state = _UBATCH.get()
    if state is None:
        return
    run = state.run
    with run.cond:
        run.hooks[(state.ubatch_id + 1) % run.n] = hook


def dbo_maybe_run_recv_hook() -> None:
    """Run (once) the receive hook a sibling attached to the caller's micro-batch, if any."""
    state = _UBATCH.get()
    if state is None:
        return
    run = state.run
    with run.cond:
        hook, run.hooks[state.ubatch_id] = run.hooks[state.ubatch_id], None
    if hook is not None:
        hook()


def _drain_hooks(run: _Run) -> None:
    """Run every pending receive hook (after an abort: nothing may stay in flight)."""
    with run.cond:
        hooks, run.hooks = run.hooks, [None] * run.n
    for hook in hooks:
        if hook is None:
            continue
        try:
            hook()
        except BaseException as exc:  # the step already failed; report, keep the first error
            logger.warning("a pending micro-batch receive hook failed while aborting: %s", exc)


def run_ubatches(fns: Sequence[Callable[[], _T]],
                 contexts: Sequence[ForwardContext]) -> list[_T]:
    """Run ``fns[i]()`` under ``contexts[i]`` as micro-batch ``i``; return their results in order.

    Micro-batch 0 runs on the caller's thread, the others on new threads; each starts from a
    copy of the caller's ``contextvars`` context with its own forward context installed, and
    inherits the caller's grad / inference mode and (on CUDA) current stream. Exactly one micro-batch computes at a time
    (see the module docstring); the first exception aborts the step and is re-raised here
    once every thread has stopped.
    """
    n = len(fns)
    if n < 2 or len(contexts) != n:
        raise ValueError(f"run_ubatches needs >= 2 micro-batches and one context each, got "
                         f"{n} callables and {len(contexts)} contexts")
    run = _Run(n)
    results: list[_T | None] = [None] * n
    inference = torch.is_inference_mode_enabled()
    grad = torch.is_grad_enabled()
    # The current CUDA stream is per thread: every micro-batch launches on the caller's.
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    def body(i: int) -> None:
        error: BaseException | None = None
        try:
            _UBATCH.set(_UBatchState(run, i))
            run.start(i)
            _event(i, "start")
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                    override_forward_context(contexts[i]), \
                    (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                results[i] = fns[i]()
            dbo_maybe_run_recv_hook()
            _event(i, "end")
        except BaseException as exc:
            error = exc
        finally:
            run.finish(i, error)

    threads = []
    for i in range(1, n):
        ctx = contextvars.copy_context()
        t = threading.Thread(target=ctx.run, args=(body, i), name=f"forwardkit-ubatch-{i}",
                             daemon=True)
        threads.append(t)
    try:
        for t in threads:
            t.start()
        contextvars.copy_context().run(body, 0)
    except BaseException as exc:  # e.g. KeyboardInterrupt in the caller: stop the siblings
        run.abort(exc)
        raise
    finally:
        for t in threads:
            if t.ident is not None:  # started
                t.join()
        if run.error is not None:
            _drain_hooks(run)
    if run.error is not None:
        raise run.error
    return cast("list[_T]", results)  # every micro-batch finished: each slot holds its result
