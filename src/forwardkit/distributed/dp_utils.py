"""DP batch coordination: one all-reduce per step so every DP rank agrees on the batch.

Implements vLLM 0.14.0's ``vllm.v1.worker.dp_utils`` protocol (spec/runtime.md §2): each
rank writes its column of a ``(5, dp_size)`` int32 tensor (unpadded tokens, padded tokens,
micro-batch vote, DP-padding vote, CUDA-graph mode), one SUM all-reduce fills every column
on every rank, and identical post-processing derives the micro-batch decision, each rank's
token count and the synchronised (minimum) CUDA-graph mode.

Unlike vLLM, the all-reduce is bounded by the DP group's timeout (a dead peer gives a
:class:`~forwardkit.distributed.parallel_state.DPCollectiveError`, not a hang).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from forwardkit.distributed.parallel_state import get_dp_group
from forwardkit.logger import init_logger
from forwardkit.ubatch import check_ubatch_thresholds, is_last_ubatch_empty

__all__ = ["coordinate_batch_across_dp"]

logger = init_logger(__name__)

# Rows of the coordination tensor (spec §2.3).
_ROW_UNPADDED, _ROW_PADDED, _ROW_UBATCH, _ROW_DP_PAD, _ROW_MODE = range(5)
_NUM_ROWS = 5


def _get_device_and_group(parallel_config: Any) -> tuple[Any, Any, bool]:
    """(device, group, use_cpu) for the coordination all-reduce (spec §2.2)."""
    group = get_dp_group()
    if getattr(parallel_config, "disable_nccl_for_dp_synchronization", False):
        logger.info_once("Using CPU all-reduce to synchronize the DP batch across ranks")
        return torch.device("cpu"), group, True
    return group.device, group, False


def _run_ar(
    should_ubatch: bool,
    should_dp_pad: bool,
    orig_num_tokens: int,
    padded_num_tokens: int,
    cudagraph_mode: int,
    parallel_config: Any,
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
    parallel_config: Any,
) -> tuple[bool, torch.Tensor, int]:
    """All-reduce and post-process (spec §2.4); identical result on every rank."""
    tensor = _run_ar(
        should_attempt_ubatching, allow_dp_padding, num_tokens_unpadded, num_tokens_padded,
        cudagraph_mode, parallel_config,
    )
    should_dp_pad = bool(torch.all(tensor[_ROW_DP_PAD] == 1))
    # Every rank must pass the same allow_dp_padding (a configuration property). As in vLLM
    # only the ranks that passed True notice a mismatch; the others carry on (spec §9.3).
    assert allow_dp_padding == should_dp_pad, (
        f"allow_dp_padding differs across DP ranks (this rank: {allow_dp_padding}, votes: "
        f"{tensor[_ROW_DP_PAD].tolist()}); every rank must pass the same value"
    )
    # num_ubatches is only consulted when every rank voted to micro-batch.
    should_ubatch = _post_process_ubatch(tensor, getattr(parallel_config, "num_ubatches", 0))
    if should_ubatch and not should_dp_pad:
        logger.debug_once("Micro-batching needs equal sizes: padding all DP ranks to the max")
        should_dp_pad = True
    num_tokens_after_padding = _post_process_dp_padding(tensor, should_dp_pad)
    return should_ubatch, num_tokens_after_padding, _post_process_cudagraph_mode(tensor)


def coordinate_batch_across_dp(
    num_tokens_unpadded: int,
    allow_microbatching: bool,
    allow_dp_padding: bool,
    parallel_config: Any,
    num_tokens_padded: int | None = None,
    uniform_decode: bool | None = None,
    num_scheduled_tokens_per_request: np.ndarray | None = None,
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
