"""A recording stand-in for ``torch.cuda.CUDAGraph`` that drives the real ``CUDAGraphWrapper``s
on CPU (used by the tests of this directory and of ``tests/runner``).

Capture runs the work once, as a real capture does, and remembers the forward context and the
call (the runnable with its captured argument tensors). Replay runs that call again on the
captured tensors under the captured context and writes the result into the captured output
tensors. That is what a CUDA graph does with memory: it reads the addresses it was captured
with (static input buffers, the previous piece's output, persistent attention metadata) and
knows nothing of the current step. So replayed results equal eager only if the runner keeps
every graph input in the same storage, which is the property being tested.

Memory is modelled as a real capture and pool treat it: a capture computes nothing, so every
captured output is filled with NaN when its capture ends (a caller that used a capture's result
as a real one sees NaN); an output the wrapper hands back to the pool inside the capture (the
last piece's, by a weak reference) is moved into one buffer shared by all such outputs, so each
replay overwrites the output of the graph replayed before it, as in a real pool. Outputs of
other pieces stay in their own memory (a real pool keeps them while later pieces read them).
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
        self.released: list[torch.Tensor] = []  # outputs handed back to the pool in capture


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            _copy_into(a, b)


class RecordingGraphs(GraphBackend):
    """Graph primitives that record instead of calling CUDA; one pool sentinel for everything."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = object()
        self.graphs: list[RecordingGraph] = []
        self._capturing: RecordingGraph | None = None
        self._shared = torch.empty(0, dtype=torch.uint8)  # the pool's reused output memory

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
        self._capturing = graph
        try:
            yield
        finally:
            self._capturing = None

    def _share(self, tensors: list[torch.Tensor]) -> None:
        """Back ``tensors`` (one graph's released outputs, side by side) by the shared buffer."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        if self._shared.numel() < sum(sizes):
            self._shared = torch.empty(sum(sizes), dtype=torch.uint8)
        offset = 0
        for t, size in zip(tensors, sizes):
            storage = self._shared.untyped_storage()
            t.set_(storage, offset // t.element_size(), t.shape, t.stride())
            offset += size

    def on_captured(self, graph: RecordingGraph, rerun: Any, output: Any) -> None:
        graph.rerun, graph.output = rerun, output
        if graph.released:
            self._share(graph.released)
        for t in _tensors(output):
            if t.is_floating_point():
                t.fill_(float("nan"))

    def replay(self, graph: RecordingGraph) -> None:
        graph.replays += 1
        with override_forward_context(graph.context):
            fresh = graph.rerun()
        _copy_into(graph.output, fresh)

    def weak_ref(self, output: Any) -> Any:
        if self._capturing is not None:  # handed back to the pool inside the capture
            self._capturing.released.extend(
                t for t in _tensors(output) if t.is_contiguous() and t.storage_offset() == 0)
        return output


def graph_counts(wrappers: dict[str, CUDAGraphWrapper]) -> dict[tuple[str, Any], int]:
    """``{(wrapper label, batch descriptor): replays}`` over every captured entry."""
    return {
        (label, desc): entry.cudagraph.replays
        for label, wrapper in wrappers.items()
        for desc, entry in wrapper.concrete_cudagraph_entries.items()
        if entry.cudagraph is not None
    }
