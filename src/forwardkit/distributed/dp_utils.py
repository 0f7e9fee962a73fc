"""DP batch coordination: one all-reduce per step so every DP rank agrees on the batch.

Implements vLLM 0.14.0's ``vllm.v1.worker.dp_utils`` protocol: each
rank writes its column of a ``(5, dp_size)`` int32 tensor (unpadded tokens, padded tokens,
micro-batch vote, DP-padding vote, CUDA-graph mode), one SUM all-reduce fills every column
on every rank, and identical post-processing derives the micro-batch decision, each rank's
token count and the synchronised (minimum) CUDA-graph mode. :class:`DPMetadata` (re-exported
by :mod:`forwardkit.forward_context`, where vLLM defines it) carries the agreed counts into
the forward context.

Unlike vLLM, the all-reduce is bounded by the DP group's timeout (a dead peer gives a
:class:`~forwardkit.distributed.parallel_state.DPCollectiveError`, not a hang).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from forwardkit.distributed.parallel_state import RankGroup, get_dp_group
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.parallel import ParallelConfig
from forwardkit.microbatching.slices import check_ubatch_thresholds, is_last_ubatch_empty

__all__ = ["DPMetadata", "coordinate_batch_across_dp", "make_dp_metadata"]

logger = init_logger(__name__)

# Rows of the coordination tensor.
_ROW_UNPADDED, _ROW_PADDED, _ROW_UBATCH, _ROW_DP_PAD, _ROW_MODE = range(5)
_NUM_ROWS = 5


def _compute_sp_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor, sequence_parallel_size: int
) -> list[int]:
    """Each DP rank's ``ceil(n / sp)``, repeated ``sp`` times (length ``dp_size * sp``)."""
    sp = sequence_parallel_size
    if sp < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {sp}")
    return [(int(n) + sp - 1) // sp for n in num_tokens_across_dp_cpu.tolist() for _ in range(sp)]


def _compute_chunked_local_num_tokens(
    num_tokens_across_dp_cpu: torch.Tensor,
    sequence_parallel_size: int,
    max_num_tokens: int,
    chunk_idx: int,
) -> list[int]:
    """Tokens per (DP, SP) rank in chunk ``chunk_idx`` of at most ``max_num_tokens`` each.

    A rank that has run out of tokens reports 1, so it still joins that chunk's collective
    (with one dummy row) and all ranks stay in lockstep.
    """
    out = []
    for total in _compute_sp_num_tokens(num_tokens_across_dp_cpu, sequence_parallel_size):
        local = min(max_num_tokens, total - max_num_tokens * chunk_idx)
        out.append(local if local > 0 else 1)
    return out


class DPMetadata:
    """Token counts of every DP rank for the current step.

    ``num_tokens_across_dp_cpu`` (1-d CPU tensor, one entry per DP rank, after DP padding),
    ``max_tokens_across_dp_cpu`` (its maximum as a 0-d tensor of the same dtype), and
    ``local_sizes`` (per-rank chunk sizes; set only inside :meth:`chunked_sizes` /
    :meth:`sp_local_sizes`). ``max_tokens_across_dp`` is the maximum as a Python int.

    Built once per step by :func:`~forwardkit.forward_context.set_forward_context`, so
    :meth:`make` does no tensor work: the counts are read once as a list, and the 0-d maximum
    tensor (which only vLLM-style readers ask for; forwardkit's MoE reads the int) is made on
    first access. Constructed directly, it behaves as vLLM's dataclass of the same fields.
    """

    __slots__ = ("_max", "_derived_max", "_num", "_counts", "local_sizes")

    def __init__(self, max_tokens_across_dp_cpu: torch.Tensor | None,
                 num_tokens_across_dp_cpu: torch.Tensor, local_sizes: list[int] | None = None,
                 ) -> None:
        self._max = max_tokens_across_dp_cpu  # None: derived from the counts when read
        self._derived_max: torch.Tensor | None = None
        self._num = num_tokens_across_dp_cpu
        self._counts: list[int] | None = None
        self.local_sizes = local_sizes

    @property
    def num_tokens_across_dp_cpu(self) -> torch.Tensor:
        """Every DP rank's token count (1-d CPU tensor)."""
        return self._num

    @num_tokens_across_dp_cpu.setter
    def num_tokens_across_dp_cpu(self, value: torch.Tensor) -> None:
        self._num, self._counts, self._derived_max = value, None, None

    @property
    def max_tokens_across_dp_cpu(self) -> torch.Tensor:
        """The largest per-rank count, a 0-d tensor of the counts' dtype (made when first read)."""
        if self._max is not None:
            return self._max
        if self._derived_max is None:
            self._derived_max = torch.max(self._num)
        return self._derived_max

    @max_tokens_across_dp_cpu.setter
    def max_tokens_across_dp_cpu(self, value: torch.Tensor) -> None:
        self._max = value

    @property
    def num_tokens_across_dp(self) -> list[int]:
        """The per-rank counts as Python ints (read from the tensor once)."""
        if self._counts is None:
            self._counts = self._num.tolist()
        return self._counts

    @property
    def max_tokens_across_dp(self) -> int:
        """The largest per-rank count as a Python int."""
        if self._max is not None:
            return int(self._max)
        return max(self.num_tokens_across_dp)

    def __repr__(self) -> str:
        return (f"DPMetadata(max_tokens_across_dp_cpu={self.max_tokens_across_dp_cpu!r}, "
                f"num_tokens_across_dp_cpu={self.num_tokens_across_dp_cpu!r}, "
                f"local_sizes={self.local_sizes!r})")

    @staticmethod
    def make(
        parallel_config: ParallelConfig, num_tokens: int, num_tokens_across_dp_cpu: torch.Tensor
    ) -> DPMetadata:
        """Build the metadata from the agreed per-rank counts (no communication).

        Asserts that DP is on (``data_parallel_size > 1``), the model is not known to be
        dense (``is_moe_model`` is not False) and this rank's entry equals ``num_tokens``
        (message: ``"<entry> <num_tokens>"``).
        """
        return make_dp_metadata(parallel_config, num_tokens, num_tokens_across_dp_cpu)

    @contextmanager
    def chunked_sizes(
        self, sequence_parallel_size: int, max_chunk_size_per_rank: int, chunk_idx: int
    ) -> Iterator[list[int]]:
        """Set ``local_sizes`` to every rank's token count in chunk ``chunk_idx``; yields it.

        Chunked MoE splits each rank's tokens into chunks of at most
        ``max_chunk_size_per_rank``; ranks that are done report 1 so collectives stay in
        lockstep. ``local_sizes`` is reset to None on exit (also on exceptions).
        """
        self.local_sizes = _compute_chunked_local_num_tokens(
            self.num_tokens_across_dp_cpu, sequence_parallel_size, max_chunk_size_per_rank,
            chunk_idx,
        )
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    @contextmanager
    def sp_local_sizes(self, sequence_parallel_size: int) -> Iterator[list[int]]:
        """Like :meth:`chunked_sizes` without chunking: ``ceil(n / sp)`` per (DP, SP) rank."""
        self.local_sizes = _compute_sp_num_tokens(
            self.num_tokens_across_dp_cpu, sequence_parallel_size
        )
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None

    def get_chunk_sizes_across_dp_rank(self) -> list[int] | None:
        """``local_sizes``; only valid inside :meth:`chunked_sizes` / :meth:`sp_local_sizes`."""
        assert self.local_sizes is not None
        return self.local_sizes

    def cu_tokens_across_sp(self, sp_size: int) -> torch.Tensor:
        """Inclusive cumulative sum of ``ceil(n / sp_size)`` repeated ``sp_size`` times (int64).

        Rank ``r``'s rows in a gathered buffer are ``[cu[r-1], cu[r])`` (0 for ``r == 0``).
        """
        if sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {sp_size}")
        per_rank = (self.num_tokens_across_dp_cpu - 1 + sp_size) // sp_size
        return torch.cumsum(per_rank.repeat_interleave(sp_size), dim=0)


def _get_device_and_group(parallel_config: ParallelConfig) -> tuple[torch.device, RankGroup, bool]:
    """(device, group, use_cpu) for the coordination all-reduce."""
    group = get_dp_group()
    if parallel_config.disable_nccl_for_dp_synchronization:
        logger.info_once("Using CPU all-reduce to synchronize the DP batch across ranks")
        return torch.device("cpu"), group, True
    return group.device, group, False


def _run_ar(
    should_ubatch: bool,
    should_dp_pad: bool,
    orig_num_tokens: int,
    padded_num_tokens: int,
    cudagraph_mode: int,
    parallel_config: ParallelConfig,
) -> torch.Tensor:
    """Write this rank's column and all-reduce the tensor over the DP group."""
    dp_size = parallel_config.data_parallel_size
    dp_rank = parallel_config.data_parallel_rank
    device, group, use_cpu = _get_device_and_group(parallel_config)
    if group.world_size != dp_size or group.rank != dp_rank:
        raise ValueError(
            f"parallel_config says DP rank {dp_rank} of {dp_size}, but the DP group is rank "
            f"{group.rank} of {group.world_size}; init_dp_group with the same parallel config"
        )
    column = torch.tensor(
        [orig_num_tokens, padded_num_tokens, int(should_ubatch), int(should_dp_pad),
         cudagraph_mode],
        dtype=torch.int32,
    )
    tensor = torch.zeros(_NUM_ROWS, dp_size, dtype=torch.int32)
    tensor[:, dp_rank] = column
    if tensor.device != device:
        tensor = tensor.to(device)
    group.all_reduce(tensor, use_cpu=use_cpu)
    return tensor


def _post_process_ubatch(tensor: torch.Tensor, num_ubatches: int) -> bool:
    """All ranks voted to micro-batch and the smallest batch still fills the last ubatch."""
    orig_min = int(tensor[_ROW_UNPADDED].min())
    padded_max = int(tensor[_ROW_PADDED].max())
    should_ubatch = bool(torch.all(tensor[_ROW_UBATCH] == 1))
    if should_ubatch and is_last_ubatch_empty(orig_min, padded_max, num_ubatches):
        logger.debug(
            "Aborting micro-batching: %d real tokens leave the last of %d ubatches of the "
            "padded %d tokens empty", orig_min, num_ubatches, padded_max,
        )
        should_ubatch = False
    return should_ubatch


def _post_process_dp_padding(tensor: torch.Tensor, should_dp_pad: bool) -> torch.Tensor:
    """Per-rank token counts (CPU int32): everyone at the max when padding, else as sent."""
    padded = tensor[_ROW_PADDED]
    if should_dp_pad:
        dp_size = padded.shape[0]
        return torch.full((dp_size,), int(padded.max()), dtype=torch.int32)
    return padded.to("cpu", torch.int32)


def _post_process_cudagraph_mode(tensor: torch.Tensor) -> int:
    """The weakest CUDA-graph mode of any rank (0 NONE < 1 PIECEWISE < 2 FULL)."""
    return int(tensor[_ROW_MODE].min())


def _synchronize_dp_ranks(
    num_tokens_unpadded: int,
    num_tokens_padded: int,
    should_attempt_ubatching: bool,
    allow_dp_padding: bool,
    cudagraph_mode: int,
    parallel_config: ParallelConfig,
) -> tuple[bool, torch.Tensor, int]:
    """All-reduce and post-process; identical result on every rank."""
    tensor = _run_ar(
        should_attempt_ubatching, allow_dp_padding, num_tokens_unpadded, num_tokens_padded,
        cudagraph_mode, parallel_config,
    )
    should_dp_pad = bool(torch.all(tensor[_ROW_DP_PAD] == 1))
    # Every rank must pass the same allow_dp_padding (a configuration property). As in vLLM
    # only the ranks that passed True notice a mismatch; the others carry on.
    assert allow_dp_padding == should_dp_pad, (
        f"allow_dp_padding differs across DP ranks (this rank: {allow_dp_padding}, votes: "
        f"{tensor[_ROW_DP_PAD].tolist()}); every rank must pass the same value"
    )
    # num_ubatches is only consulted when every rank voted to micro-batch.
    should_ubatch = _post_process_ubatch(tensor, parallel_config.num_ubatches)
    if should_ubatch and not should_dp_pad:
        logger.debug_once("Micro-batching needs equal sizes: padding all DP ranks to the max")
        should_dp_pad = True
    num_tokens_after_padding = _post_process_dp_padding(tensor, should_dp_pad)
    return should_ubatch, num_tokens_after_padding, _post_process_cudagraph_mode(tensor)


_new_object = object.__new__


def make_dp_metadata(parallel_config: ParallelConfig, num_tokens: int,
                     num_tokens_across_dp_cpu: torch.Tensor) -> DPMetadata:
    """:meth:`DPMetadata.make` (the forward context calls this directly, once a step).

    Asserts that DP is on, the model is not known to be dense and this rank's entry equals
    ``num_tokens`` (message ``"<entry> <num_tokens>"``); reads the counts once as a list.
    """
    assert num_tokens_across_dp_cpu is not None
    assert parallel_config.data_parallel_size > 1
    assert parallel_config.is_moe_model is not False
    if type(num_tokens_across_dp_cpu) is not torch.Tensor and not isinstance(
            num_tokens_across_dp_cpu, torch.Tensor):
        num_tokens_across_dp_cpu = torch.tensor(num_tokens_across_dp_cpu, dtype=torch.int32)
    # NOTE: one tolist() (~0.3 us) instead of indexing and torch.max (~1.5 us each); the
    # instance is filled directly (its __init__ call costs ~0.2 us a step).
    counts = num_tokens_across_dp_cpu.tolist()
    mine = counts[parallel_config.data_parallel_rank]
    assert mine == num_tokens, f"{mine} {num_tokens}"
    meta: DPMetadata = _new_object(DPMetadata)
    meta._max = None
    meta._derived_max = None
    meta._num = num_tokens_across_dp_cpu
    meta._counts = counts
    meta.local_sizes = None
    return meta


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    allow_dp_padding: bool,
    parallel_config: ParallelConfig,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    num_scheduled_tokens_per_request: np.ndarray | Sequence[int] | None = None,
    cudagraph_mode: int = 0,
) -> tuple[bool, torch.Tensor | None, int]:
    """Agree with every DP rank on micro-batching, per-rank token counts and graph mode.

    A collective: every DP rank must call it once per step (idle ranks with a dummy batch).

    Args:
        num_tokens_unpadded: real tokens of this rank's step.
        allow_microbatching: try to micro-batch (needs ``uniform_decode``).
        allow_dp_padding: pad every rank to the largest padded count; must be the same on
            every rank (vLLM passes ``cudagraph_mode != NONE`` of the config).
        parallel_config: read ``data_parallel_size``, ``data_parallel_rank``,
            ``num_ubatches``, DBO thresholds, ``disable_nccl_for_dp_synchronization``.
        num_tokens_padded: tokens after CUDA-graph / SP padding (default: unpadded).
        uniform_decode: whether the batch is uniform decode (only used to micro-batch).
        num_scheduled_tokens_per_request: accepted for vLLM compatibility, unused.
        cudagraph_mode: this rank's runtime mode value (0 NONE, 1 PIECEWISE, 2 FULL).

    Returns:
        ``(should_ubatch, num_tokens_after_padding, synced_cudagraph_mode)``:
        ``num_tokens_after_padding`` is a CPU int32 tensor of length ``dp_size`` (None when
        DP is off) and the synced mode is the minimum over ranks. Identical on every rank.
        With ``data_parallel_size == 1`` returns ``(False, None, cudagraph_mode)`` at once.
    """
    if parallel_config.data_parallel_size == 1:
        return False, None, cudagraph_mode
    if cudagraph_mode not in (0, 1, 2):
        raise ValueError(
            f"cudagraph_mode must be a runtime mode value 0 (NONE), 1 (PIECEWISE) or "
            f"2 (FULL), got {cudagraph_mode!r}"
        )

    should_attempt_ubatching = False
    if allow_microbatching:
        assert uniform_decode is not None, "uniform_decode is required to micro-batch"
        should_attempt_ubatching = check_ubatch_thresholds(
            parallel_config, num_tokens_unpadded, uniform_decode
        )
    if num_tokens_padded is None:
        num_tokens_padded = num_tokens_unpadded
    assert num_tokens_padded >= num_tokens_unpadded, (
        f"num_tokens_padded ({num_tokens_padded}) < num_tokens_unpadded ({num_tokens_unpadded})"
    )
    return _synchronize_dp_ranks(
        num_tokens_unpadded, num_tokens_padded, should_attempt_ubatching, allow_dp_padding,
        cudagraph_mode, parallel_config,
    )
