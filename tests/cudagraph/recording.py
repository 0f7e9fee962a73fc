"""A recording stand-in for ``torch.cuda.CUDAGraph`` that drives the real ``CUDAGraphWrapper``s
on CPU (used by the tests of this directory and of ``tests/runner``).

Capture runs the work once, as a real capture does, and remembers the forward context and the
call (the runnable with its captured argument tensors). Replay runs that call again on the
captured tensors under the captured context and writes the result into the captured output
tensors. That is what a CUDA graph does with memory: it reads the addresses it was captured
with (static input buffers, the previous piece's output, persistent attention metadata) and
knows nothing of the current step. So replayed results equal eager only if the runner keeps
every graph input in the same storage, which is the property being tested.

Outputs are kept as strong references (the "graph pool" keeps them alive); on a GPU they are
weak references into the pool.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

from forwardkit.cudagraph.wrapper import CUDAGraphWrapper, GraphBackend
from forwardkit.forward_context import get_forward_context, override_forward_context

__all__ = ["RecordingGraph", "RecordingGraphs", "graph_counts"]

_REAL_GC_COLLECT = gc.collect


class RecordingGraph:
    """One 'captured graph': what ran, under which context, and how often it was replayed."""

    def __init__(self) -> None:
        self.context: Any = None
        self.rerun: Any = None
        self.output: Any = None
        self.pool: Any = None
        self.replays = 0
        self.gc_kept = False  # the capture ran with gc.collect live (the first piece syncs)


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            _copy_into(a, b)


class RecordingGraphs(GraphBackend):
    """Graph primitives that record instead of calling CUDA; one pool sentinel for everything."""

    def __init__(self) -> None:
        self.pool = object()
        self.graphs: list[RecordingGraph] = []

    def graph_pool(self) -> Any:
        return self.pool

    def new_graph(self) -> RecordingGraph:
        graph = RecordingGraph()
        self.graphs.append(graph)
        return graph

    @contextlib.contextmanager
    def capture(self, graph: RecordingGraph, pool: Any):
        graph.pool = pool
        graph.context = get_forward_context()
        graph.gc_kept = gc.collect is _REAL_GC_COLLECT
        yield

    def on_captured(self, graph: RecordingGraph, rerun: Any, output: Any) -> None:
        graph.rerun, graph.output = rerun, output

    def replay(self, graph: RecordingGraph) -> None:
        graph.replays += 1
        with override_forward_context(graph.context):
            fresh = graph.rerun()
        _copy_into(graph.output, fresh)

    def weak_ref(self, output: Any) -> Any:
        return output


def graph_counts(wrappers: dict[str, CUDAGraphWrapper]) -> dict[tuple[str, Any], int]:
    """``{(wrapper label, batch descriptor): replays}`` over every captured entry."""
    return {
        (label, desc): entry.cudagraph.replays
        for label, wrapper in wrappers.items()
        for desc, entry in wrapper.concrete_cudagraph_entries.items()
        if entry.cudagraph is not None
    }
