"""``StepPlanner``: the one owner of per-step batch planning (padding, DP agreement, graph mode).

The CUDA-graph mode the planner serves is the engine config's
(``EngineConfig.served_cudagraph_mode``: what the config asks for, lowered to what the device
and the attention backend can honour, decided in ``config/engine_graphs.py``); it is read once
and fixed from then on. Per step :meth:`StepPlanner.plan`
decides, in order (vLLM: ``GPUModelRunner._determine_batch_execution_and_padding``):

1. whether the batch is a uniform decode (every request ``uniform_decode_query_len`` tokens);
2. sequence-parallel rounding to a TP multiple;
3. the dispatcher's runtime mode and padded ``BatchDescriptor`` (NONE, unpadded, when forced);
4. with ``data_parallel_size > 1``: one all-reduce so every rank agrees on the padded count
   and the lowest mode, then a re-dispatch at the agreed count with FULL disabled when any
   rank could not run FULL;
5. a micro-batched FULL step of a size without a micro-batched graph (one no decode step can
   split: :meth:`StepPlanner.microbatched_capture_descs`) runs NONE;
6. an optional ``CUDAGraphStat`` when ``engine_config.observability_config.cudagraph_metrics`` is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.cudagraph.dispatcher import CudagraphDispatcher
from forwardkit.cudagraph.metrics import CUDAGraphStat
from forwardkit.distributed import coordinate_batch_across_dp
from forwardkit.forward_context import BatchDescriptor
from forwardkit.logger import init_logger
from forwardkit.microbatching.slices import check_ubatch_thresholds, is_last_ubatch_empty

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["StepPlan", "StepPlanner", "is_uniform_decode"]

logger = init_logger(__name__)


class StepPlan(NamedTuple):
    """How one step runs: runtime mode, padded descriptor, DP token counts, optional stat, and
    whether every DP rank agreed to micro-batch it (dual-batch overlap)."""

    cudagraph_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor
    num_tokens_across_dp: torch.Tensor | None
    cudagraph_stats: CUDAGraphStat | None
    should_ubatch: bool = False


def is_uniform_decode(max_num_scheduled_tokens: int, uniform_decode_query_len: int,
                      num_tokens: int, num_reqs: int) -> bool:
    """Every request has exactly ``uniform_decode_query_len`` tokens."""
    return (
        max_num_scheduled_tokens == uniform_decode_query_len
        and num_tokens == max_num_scheduled_tokens * num_reqs
    )


class StepPlanner:
    """Decides padding, DP agreement and runtime mode for every step of one runner.

    Args:
        engine_config: the engine config (``compilation_config``, ``scheduler_config``,
            ``parallel_config``, ``speculative_config``, ``lora_config``,
            ``observability_config``).
        cudagraph_mode: the mode to serve; None (the runner) = the config's
            ``served_cudagraph_mode``. Tests pass a mode to plan states no device here can
            serve. Fixed for the planner's life and readable as :attr:`cudagraph_mode`.
        coordinate_fn: the DP agreement collective (default
            ``forwardkit.distributed.coordinate_batch_across_dp``); every rank must call it.
    """

    def __init__(self, engine_config: EngineConfig, cudagraph_mode: CUDAGraphMode | None = None,
                 coordinate_fn: Callable[..., tuple[bool, Any, int]] | None = None) -> None:
        self.engine_config = engine_config
        if cudagraph_mode is None:
            cudagraph_mode = engine_config.served_cudagraph_mode
        self.dispatcher = CudagraphDispatcher(engine_config)
        self.dispatcher.initialize_cudagraph_keys(cudagraph_mode)
        self.coordinate_fn = coordinate_fn or coordinate_batch_across_dp
        parallel = engine_config.parallel_config
        self.dp_size = parallel.data_parallel_size
        self.dp_rank = parallel.data_parallel_rank
        self.use_ubatching = bool(parallel.use_ubatching)
        # vLLM pads across DP ranks whenever the config asks for graphs, even where this rank
        # runs eagerly (so the ranks' shapes agree); read once, like the mode.
        configured = engine_config.compilation_config.cudagraph_mode
        self.allow_dp_padding = CUDAGraphMode.parse(configured or CUDAGraphMode.NONE) != CUDAGraphMode.NONE
        self.collect_stats = bool(engine_config.observability_config.cudagraph_metrics)
        self.max_num_seqs = int(engine_config.scheduler_config.max_num_seqs)
        self.sp_multiple = engine_config.sequence_parallel_multiple  # read once, not per step
        # the padded sizes a micro-batched FULL step replays a graph for (planned, not patched)
        self._microbatched_sizes = frozenset(d.num_tokens for d in self.microbatched_capture_descs())

    @property
    def cudagraph_mode(self) -> CUDAGraphMode:
        """The resolved graph mode (read-only)."""
        return self.dispatcher.cudagraph_mode

    @property
    def uniform_decode_query_len(self) -> int:
        """Tokens per request of a uniform-decode step (1 + speculative tokens)."""
        return self.dispatcher.uniform_decode_query_len

    def capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What start-up captures, in capture order (see ``CudagraphDispatcher.get_capture_descs``)."""
        return self.dispatcher.get_capture_descs()

    def microbatched_capture_descs(self) -> list[BatchDescriptor]:
        """The uniform-decode FULL sizes that also get a micro-batched graph, largest first:
        those at or above ``dbo_decode_token_threshold`` whose last micro-batch holds a real
        token (a uniform-decode dummy step of the size is not padded). Empty unless
        micro-batching is configured and the mode has FULL graphs."""
        parallel = self.engine_config.parallel_config
        if not (self.use_ubatching and self.cudagraph_mode.has_full_cudagraphs()):
            return []
        out = []
        for mode, descs in self.capture_descs():
            if mode != CUDAGraphMode.FULL:
                continue
            for desc in descs:
                # a decode step of this padded size has at most max_num_seqs real tokens
                n, real = desc.num_tokens, min(desc.num_tokens, self.max_num_seqs)
                if (desc.uniform and check_ubatch_thresholds(parallel, real, True)
                        and not is_last_ubatch_empty(real, n, parallel.num_ubatches)):
                    out.append(desc)
        return sorted(out, key=lambda d: d.num_tokens, reverse=True)

    def plan(self, num_tokens: int, num_reqs: int, num_scheduled_tokens: Sequence[int],
             max_num_scheduled_tokens: int, *, force_eager: bool = False,
             force_uniform_decode: bool | None = None, pad_to: int | None = None,
             allow_microbatching: bool = True, has_lora: bool = False) -> StepPlan:
        """Plan one step of ``num_tokens`` tokens over ``num_reqs`` requests.

        ``force_eager`` (warm-up, ``pad_to``) dispatches NONE; ``force_uniform_decode``
        overrides the derived uniform-decode flag (dummy runs); ``pad_to`` forces an eager step
        padded to at least that many tokens (tests use it to show padding never changes
        results). With DP > 1 this is a collective: every rank must plan every step.
        ``allow_microbatching`` False makes this rank vote against micro-batching (dummy steps),
        which keeps every rank off it this step; ``has_lora`` (a request of the step has an
        adapter) is the descriptor's ``has_lora`` key; with micro-batching configured
        (``ParallelConfig.use_ubatching``) the plan's ``should_ubatch`` is the agreed decision,
        the same on every rank.
        """
        cfg = self.engine_config
        uniform = (bool(force_uniform_decode) if force_uniform_decode is not None else
                   is_uniform_decode(max_num_scheduled_tokens, self.uniform_decode_query_len,
                                     num_tokens, num_reqs))
        eager = force_eager or pad_to is not None
        tp = self.sp_multiple
        num_tokens_padded = -(-num_tokens // tp) * tp

        def dispatch(n: int, disable_full: bool) -> tuple[CUDAGraphMode, BatchDescriptor]:
            if eager:
                return CUDAGraphMode.NONE, BatchDescriptor(max(n, pad_to or 0), has_lora=has_lora)
            mode, desc = self.dispatcher.dispatch(n, uniform, has_lora, disable_full)
            if mode == CUDAGraphMode.NONE and has_lora:
                desc = BatchDescriptor(desc.num_tokens, has_lora=True)
            return mode, desc

        mode, desc = dispatch(num_tokens_padded, False)
        num_tokens_padded = desc.num_tokens
        assert num_tokens_padded % tp == 0, (
            f"padded token count {num_tokens_padded} is not a multiple of the TP size {tp} needed "
            "by sequence parallelism; make every capture size a multiple of it"
        )
        across_dp = None
        should_ubatch = False
        if self.dp_size > 1:
            should_ubatch, across_dp, synced_mode = self.coordinate_fn(
                num_tokens_unpadded=num_tokens,
                parallel_config=cfg.parallel_config,
                allow_microbatching=allow_microbatching and self.use_ubatching,
                allow_dp_padding=self.allow_dp_padding,
                num_tokens_padded=num_tokens_padded,
                uniform_decode=uniform,
                num_scheduled_tokens_per_request=num_scheduled_tokens,
                cudagraph_mode=mode.value,
            )
            if across_dp is not None:
                num_tokens_padded = int(across_dp[self.dp_rank])
                mode, desc = dispatch(num_tokens_padded, synced_mode <= CUDAGraphMode.PIECEWISE.value)
                assert desc.num_tokens == num_tokens_padded, (
                    f"re-dispatch after DP sync padded {num_tokens_padded} tokens to "
                    f"{desc.num_tokens}; the agreed per-rank token counts would be wrong"
                )
        if (should_ubatch and mode == CUDAGraphMode.FULL
                and desc.num_tokens not in self._microbatched_sizes):
            logger.info_once("no micro-batched graph for %d tokens (no decode step of that size "
                             "splits): its micro-batches run eagerly", desc.num_tokens)
            mode = CUDAGraphMode.NONE
        stats = None
        if self.collect_stats:
            stats = CUDAGraphStat(
                num_unpadded_tokens=num_tokens,
                num_padded_tokens=desc.num_tokens,
                num_paddings=desc.num_tokens - num_tokens,
                runtime_mode=str(mode),
            )
        return StepPlan(mode, desc, across_dp, stats, bool(should_ubatch))
