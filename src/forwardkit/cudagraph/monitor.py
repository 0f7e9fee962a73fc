"""Process-wide CUDA-graph capture state: the capture guard, the capture counter, gc handling.

* ``cudagraph_capturing_enabled``: the runner enables capture only
  around ``capture_model``; a capture triggered later by an unexpected descriptor raises
  instead of silently stalling a step.
* :func:`record_capture`: counts captures in
  ``forwardkit.compilation.counters.compilation_counter.num_cudagraph_captured``.
* :func:`capture_session`: what the runner wraps its capture loop in: capture
  enabled, ``gc.collect()`` + ``gc.freeze()`` (unless ``FORWARDKIT_ENABLE_CUDAGRAPH_GC=1``),
  and everything restored afterwards.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from forwardkit import envs
from forwardkit.compilation.counters import compilation_counter

__all__ = [
    "capture_session",
    "cudagraph_capturing_enabled",
    "freeze_gc_for_capture",
    "record_capture",
    "set_cudagraph_capturing_enabled",
    "validate_cudagraph_capturing_enabled",
]

cudagraph_capturing_enabled: bool = True


def set_cudagraph_capturing_enabled(enabled: bool) -> None:
    """Allow (True) or forbid (False) new CUDA-graph captures in this process."""
    global cudagraph_capturing_enabled
    cudagraph_capturing_enabled = bool(enabled)


def validate_cudagraph_capturing_enabled() -> None:
    """Raise ``RuntimeError`` when a capture is attempted while capturing is forbidden."""
    if not cudagraph_capturing_enabled:
        raise RuntimeError(
            "CUDA graph capturing detected at an inappropriate time. "
            "This operation is currently disabled."
        )



def record_capture() -> int:
    """Count one finished capture; returns the process total (per-mode counts are kept by
    each runner's ``GraphBackend.captured``)."""
    compilation_counter.num_cudagraph_captured += 1
    return compilation_counter.num_cudagraph_captured


@contextlib.contextmanager
def freeze_gc_for_capture() -> Iterator[bool]:
    """``gc.collect()`` then ``gc.freeze()`` for the block (yields whether it froze).

    Freezing moves every live object out of the collector's reach, so the ``gc.collect()``
    that each graph capture performs on entry is cheap. ``FORWARDKIT_ENABLE_CUDAGRAPH_GC=1``
    keeps the collector fully active instead. On exit: ``gc.unfreeze()`` and ``gc.collect()``.
    """
    gc.collect()
    freeze = not envs.FORWARDKIT_ENABLE_CUDAGRAPH_GC
    if freeze:
        gc.freeze()
    try:
        yield freeze
    finally:
        if freeze:
            gc.unfreeze()
        gc.collect()


@contextlib.contextmanager
def capture_session() -> Iterator[None]:
    """Enable capture and freeze gc for the block; capture is forbidden again afterwards."""
    set_cudagraph_capturing_enabled(True)
    try:
        with freeze_gc_for_capture():
            yield
    finally:
        set_cudagraph_capturing_enabled(False)
