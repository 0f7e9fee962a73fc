"""Micro-batch (ubatch) slicing: split one step's tokens into equal-sized micro-batches.

Behaviour follows vLLM 0.14.0's ``vllm.v1.worker.ubatch_utils``.
Micro-batching (dual batch overlap) only happens with DP > 1; the decision is made by
:func:`forwardkit.distributed.dp_utils.coordinate_batch_across_dp`, and the slices produced
here end up in ``ForwardContext.ubatch_slices``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from forwardkit.config.parallel import ParallelConfig

__all__ = [
    "UBatchSlice",
    "UBatchSlices",
    "check_ubatch_thresholds",
    "is_last_ubatch_empty",
    "maybe_create_ubatch_slices",
]


@dataclass
class UBatchSlice:
    """One micro-batch: the requests and the tokens it covers (both half-open ``slice``s).

    A request that straddles a micro-batch boundary appears in both neighbouring slices.
    """

    request_slice: slice
    token_slice: slice

    def is_empty(self) -> bool:
        """True when the slice covers no request or no token."""
        return (
            self.request_slice.start == self.request_slice.stop
            or self.token_slice.start == self.token_slice.stop
        )

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the slice (``token_slice.stop - token_slice.start``)."""
        return self.token_slice.stop - self.token_slice.start


UBatchSlices = list[UBatchSlice]
"""A step's micro-batches, in order (type alias of ``list[UBatchSlice]``)."""


def check_ubatch_thresholds(config: ParallelConfig, num_tokens: int, uniform_decode: bool) -> bool:
    """Whether a batch of ``num_tokens`` is big enough to be worth micro-batching.

    ``config`` is the parallel config (read: ``use_ubatching``, ``dbo_decode_token_threshold``,
    ``dbo_prefill_token_threshold``). Uniform-decode batches use the decode threshold
    (default 32), batches with prefills the prefill threshold (default 512); both inclusive.
    """
    if not config.use_ubatching:
        return False
    if uniform_decode:
        return num_tokens >= config.dbo_decode_token_threshold
    return num_tokens >= config.dbo_prefill_token_threshold


def is_last_ubatch_empty(orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int) -> bool:
    """Whether all ``orig_num_tokens`` real tokens fit in the first ``num_ubatches - 1`` splits.

    The padded batch is split into ``num_ubatches`` equal parts of
    ``padded_num_tokens // num_ubatches``; if the real tokens end before the last part
    starts, the last micro-batch would hold only padding, so micro-batching is aborted.
    """
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    return (padded_num_tokens // num_ubatches) * (num_ubatches - 1) >= orig_num_tokens


def _split_boundaries(num_tokens_padded: int, num_ubatches: int, split_point: Any) -> list[int]:
    if split_point is None:
        split_point = num_tokens_padded // num_ubatches
    elif isinstance(split_point, (list, tuple)):
        # NOTE: vLLM's signature accepts a list but then multiplies it as a scalar;
        # a one-element list is the only form that has a sensible meaning, so accept just that.
        if len(split_point) != 1:
            raise ValueError(
                f"split_point must be an int or a one-element list, got {split_point!r}"
            )
        split_point = split_point[0]
    split_point = int(split_point)
    if split_point <= 0:
        raise ValueError(f"split_point must be a positive token count, got {split_point}")
    return [split_point * i for i in range(1, num_ubatches)]


def maybe_create_ubatch_slices(
    should_ubatch: bool,
    num_scheduled_tokens: np.ndarray,
    num_tokens_padded: int,
    num_reqs_padded: int,
    num_ubatches: int,
    split_point: list[int] | int | None = None,
) -> tuple[UBatchSlices | None, UBatchSlices | None]:
    """Split a step into ``num_ubatches`` micro-batches; returns ``(unpadded, padded)`` slices.

    Returns ``(None, None)`` when ``should_ubatch`` is false. Token boundaries are multiples
    of ``split_point`` (default ``num_tokens_padded // num_ubatches``); the unpadded set ends
    at the real token total, the padded set's last slice extends to ``num_reqs_padded`` /
    ``num_tokens_padded``. Callers guard against an empty last micro-batch with
    :func:`is_last_ubatch_empty` (without that guard the last unpadded slice can be inverted,
    exactly as in vLLM).
    """
    if not should_ubatch:
        return None, None
    if num_ubatches < 2:
        raise ValueError(f"num_ubatches must be >= 2 to micro-batch, got {num_ubatches}")

    boundaries = _split_boundaries(num_tokens_padded, num_ubatches, split_point)
    cu = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int32)
    np.cumsum(num_scheduled_tokens, dtype=np.int32, out=cu[1:])
    boundaries.append(int(cu[-1]))

    unpadded: UBatchSlices = []
    start = 0
    for end in boundaries:
        first_req = int(np.searchsorted(cu, start, side="right")) - 1
        req_stop = int(np.searchsorted(cu, end, side="left"))
        unpadded.append(UBatchSlice(slice(first_req, req_stop), slice(start, end)))
        start = end

    padded = [UBatchSlice(s.request_slice, s.token_slice) for s in unpadded[:-1]]
    last = unpadded[-1]
    padded.append(
        UBatchSlice(
            slice(last.request_slice.start, num_reqs_padded),
            slice(last.token_slice.start, num_tokens_padded),
        )
    )
    total = sum(s.num_tokens for s in padded)
    assert total == num_tokens_padded, (
        f"padded micro-batches cover {total} tokens, expected {num_tokens_padded}"
    )
    return unpadded, padded
