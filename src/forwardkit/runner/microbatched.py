"""The runner's micro-batched forward (dual-batch overlap): one planned step run as micro-batches
that take turns, each with its own forward context.

This is the execution-layer piece of micro-batching. It lives in the runner package, not in
``forwardkit/microbatching/``, because it builds attention metadata (the model layer's attention
backend), replays micro-batched graphs (``cudagraph/ubatch_graphs.py``) and calls the model:
``microbatching/`` sits in the step-state layer, below all of them, and holds only what they
read (where a step is split, the turn-taking of ``run_ubatches``, the ``dbo_*`` helpers).
``ModelRunner`` owns one :class:`MicrobatchedForward` and calls it for every step its planner
marks ``should_ubatch`` (``execute`` and ``dummy_run``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable

import numpy as np
import torch

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.cudagraph.ubatch_graphs import UBatchGraphs
from forwardkit.distributed.dp_utils import DPMetadata
from forwardkit.forward_context import (
    AttnMetadataDict,
    BatchDescriptor,
    ForwardContext,
    StepAttentionMetadata,
    create_forward_context,
    set_forward_context,
)
from forwardkit.layers.attention_backend import AttentionBackend
from forwardkit.microbatching.overlap import run_ubatches
from forwardkit.microbatching.slices import UBatchSlice, UBatchSlices, maybe_create_ubatch_slices

__all__ = ["MicrobatchedForward", "Requests", "ubatch_requests"]

Requests = tuple[list[int], list[int], list[list[int]]]
"""Query lengths, sequence lengths and block tables of a step's requests."""


def ubatch_requests(cu: np.ndarray, seq_lens: list[int], block_tables: list[list[int]],
                    sl: UBatchSlice) -> Requests:
    """Query lengths, sequence lengths and block tables of the requests in micro-batch ``sl``
    (real tokens only; ``cu``: the step's cumulative query lengths). A request cut by a
    boundary keeps only its tokens inside the slice: before the cut its sequence ends where the
    slice ends."""
    q, s, b = [], [], []
    stop = min(sl.request_slice.stop, len(seq_lens))
    for r in range(sl.request_slice.start, stop):
        first, end = max(int(cu[r]), sl.token_slice.start), min(int(cu[r + 1]), sl.token_slice.stop)
        if end <= first:
            continue
        q.append(end - first)
        s.append(seq_lens[r] - (int(cu[r + 1]) - end))
        b.append(block_tables[r])
    return q, s, b


class MicrobatchedForward:
    """Runs a step the planner marked ``should_ubatch`` as ``num_ubatches`` micro-batches.

    Built by the runner from what a micro-batch needs of it: the engine config, the attention
    backend and the names of the layers that read its metadata, the KV block size and device,
    the DP size, the micro-batched FULL graphs (None when the mode has none), the runner's
    fixed-shape metadata builder (``full_metadata(query_lens, seq_lens, block_tables, padded,
    key)``, persistent tensors per key) and its ``unfold`` of speculative requests into
    one-token rows.
    """

    def __init__(self, engine_config: EngineConfig, backend: type[AttentionBackend],
                 layer_names: list[str], block_size: int, device: torch.device, dp_size: int,
                 graphs: UBatchGraphs | None,
                 full_metadata: Callable[[list[int], list[int], list[list[int]], int, Hashable],
                                         StepAttentionMetadata],
                 unfold: Callable[[list[int], list[int], list[list[int]]], Requests]) -> None:
        self.engine_config = engine_config
        self.backend, self.layer_names = backend, layer_names
        self.block_size, self.device, self.dp_size = block_size, device, dp_size
        self.graphs = graphs
        self.full_metadata, self.unfold = full_metadata, unfold

    def run(self, model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
            input_ids: torch.Tensor, positions: torch.Tensor, mode: CUDAGraphMode,
            desc: BatchDescriptor, across_dp: torch.Tensor | None) -> tuple[torch.Tensor, UBatchSlices]:
        """Run the step as micro-batches that take turns (dual-batch overlap).

        Each micro-batch gets its own forward context: attention metadata of its requests (a
        request split by a boundary is trimmed to its tokens on each side), ``DPMetadata`` of
        its token count on every rank (all ranks split the same padded total), runtime mode
        NONE. The outer context carries the padded ``ubatch_slices`` and the list of
        per-micro-batch metadata, as in vLLM. Returns the concatenated hidden states and the
        padded slices.

        With ``mode`` FULL (the planner gives it only for sizes with a micro-batched graph,
        ``StepPlanner.microbatched_capture_descs``) the step is one micro-batched graph
        (:class:`~forwardkit.cudagraph.ubatch_graphs.UBatchGraphs`): each micro-batch's
        metadata covers its padded slice (padding rows as dummy requests on the scratch block)
        in persistent tensors, and after the capture a step replays the graph without threads.
        """
        cfg, pc = self.engine_config, self.engine_config.parallel_config
        padded = desc.num_tokens
        graphs = self.graphs if mode == CUDAGraphMode.FULL else None
        assert mode != CUDAGraphMode.FULL or graphs is not None, (
            "a FULL micro-batched step needs the runner's micro-batched graphs "
            "(micro-batching configured and a mode with FULL graphs)"
        )
        unpadded_slices, slices = maybe_create_ubatch_slices(
            True, np.asarray(query_lens), padded, len(query_lens), pc.num_ubatches)
        assert unpadded_slices is not None and slices is not None
        cu = np.concatenate([[0], np.cumsum(query_lens)])
        metadata: list[AttnMetadataDict] = []
        contexts: list[ForwardContext] = []
        fns: list[Callable[[], torch.Tensor]] = []
        for i, (real, sl) in enumerate(zip(unpadded_slices, slices)):
            q, s, b = self.unfold(*ubatch_requests(cu, seq_lens, block_tables, real))
            if graphs is not None:
                md = self.full_metadata(q, s, b, sl.num_tokens, (padded, i))
            else:
                md = self.backend.build_metadata(q, s, b, sl.num_tokens, self.block_size,
                                                 self.device)
            attn: AttnMetadataDict = dict.fromkeys(self.layer_names, md)
            metadata.append(attn)
            dp_md = None
            if self.dp_size > 1:
                dp_md = DPMetadata.make(pc, sl.num_tokens,
                                        torch.full((self.dp_size,), sl.num_tokens, dtype=torch.int32))
            contexts.append(create_forward_context(attn, cfg, dp_metadata=dp_md,
                                                   cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                                   batch_descriptor=desc))
            tok = sl.token_slice
            fns.append(functools.partial(model, input_ids[tok], positions[tok]))
        with set_forward_context(metadata, cfg, num_tokens=padded, num_tokens_across_dp=across_dp,
                                 cudagraph_runtime_mode=mode, batch_descriptor=desc,
                                 ubatch_slices=slices):
            if graphs is not None:
                hidden = graphs.run(padded, lambda: torch.cat(run_ubatches(fns, contexts)))
            else:
                hidden = torch.cat(run_ubatches(fns, contexts))
        return hidden, slices
