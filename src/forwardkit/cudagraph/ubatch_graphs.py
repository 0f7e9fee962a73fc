"""Micro-batched FULL CUDA graphs: one graph per padded size holds every micro-batch of a
dual-batch-overlap (DBO) step.

A DBO step runs its micro-batches on threads that take turns at yield points (see
:mod:`forwardkit.microbatching.overlap`); all of them launch on the caller's stream. Capturing that step
records the kernels of both micro-batches, interleaved at the yield points exactly as they ran,
plus the concatenation of their outputs, into one graph. A replay launches that graph: the
overlap is baked in, so replay starts no threads and sets no per-micro-batch context.

The runner owns one :class:`UBatchGraphs` when micro-batching is configured and the resolved
graph mode has FULL graphs. It keys graphs by the step's padded token count (the split is a
function of it, so both micro-batches have fixed shapes per key) and keeps their attention
metadata in persistent tensors, as for ordinary FULL graphs.

Difference from vLLM 0.14.0's ``UBatchWrapper``, on purpose: a size that has a micro-batched
graph keeps its ordinary FULL graph too. vLLM captures only the micro-batched one and runs a
step of that size eagerly whenever the DP ranks did not all vote for micro-batching (one rank
below the threshold); here that step replays the ordinary graph instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forwardkit.cudagraph.wrapper import Graph, GraphBackend
from forwardkit.logger import init_logger

__all__ = ["MICROBATCHED_FULL", "UBatchGraphs"]

logger = init_logger(__name__)

# The label these captures are counted under in ``GraphBackend.captured`` (and so in the
# runner's ``capture_stats`` and capture log line), beside "FULL" and "PIECEWISE".
MICROBATCHED_FULL = "FULL_MICROBATCHED"


class _Entry:
    __slots__ = ("graph", "output", "replays")

    def __init__(self, graph: Graph, output: torch.Tensor) -> None:
        self.graph = graph
        self.output = output
        self.replays = 0


class UBatchGraphs:
    """Captures and replays micro-batched FULL graphs, one per padded token count.

    Args:
        graph_backend: the graph primitives (shared with the runner's other wrappers, so all
            captures use one memory pool).
    """

    def __init__(self, graph_backend: GraphBackend) -> None:
        self.graph_backend = graph_backend
        self.graph_pool: object = None  # fetched at the first capture, like CUDAGraphWrapper's
        self._entries: dict[int, _Entry] = {}

    def __contains__(self, num_tokens: object) -> bool:
        return num_tokens in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def sizes(self) -> list[int]:
        """Padded token counts that have a captured graph, ascending."""
        return sorted(self._entries)

    def replays(self, num_tokens: int) -> int:
        """How often the graph of ``num_tokens`` was replayed (0 when there is none)."""
        entry = self._entries.get(num_tokens)
        return 0 if entry is None else entry.replays

    def run(self, num_tokens: int, run_ubatches: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The hidden states of a micro-batched FULL step of ``num_tokens`` padded tokens.

        The first call for a size captures ``run_ubatches()`` (which runs every micro-batch
        and returns their outputs concatenated in micro-batch order); it must happen while
        capture is enabled (the runner's ``capture_model``), like any capture. Later calls
        replay the graph and return the same output tensor, which the next replay overwrites:
        consume it first.
        """
        entry = self._entries.get(num_tokens)
        if entry is not None:
            entry.replays += 1
            self.graph_backend.replay(entry.graph)
            return entry.output
        logger.debug("Capturing a micro-batched FULL cudagraph for %d tokens", num_tokens)
        if self.graph_pool is None:
            self.graph_pool = self.graph_backend.graph_pool()

        def run_checked() -> torch.Tensor:
            output = run_ubatches()
            if not isinstance(output, torch.Tensor):
                raise TypeError("a micro-batched graph must produce one tensor (the micro-batch "
                                f"outputs concatenated), got {type(output).__name__}")
            return output

        # The output goes back to the pool at once (the runner consumes it before the next replay).
        graph, output, replay_output = self.graph_backend.capture_call(
            self.graph_pool, run_checked, MICROBATCHED_FULL, release_output=True)
        self._entries[num_tokens] = _Entry(graph, replay_output)
        return output
