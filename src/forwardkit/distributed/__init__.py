"""Data parallelism on ``torch.distributed``: the DP group, batch coordination, a launcher.

* :func:`init_dp_group` / :func:`get_dp_group` / :func:`destroy_dp_group` — the DP process
  group (gloo CPU group + device group), every collective bounded by a timeout.
* :func:`coordinate_batch_across_dp` — the per-step all-reduce that makes DP ranks agree on
  padding, micro-batching and CUDA-graph mode.
* :func:`forwardkit.distributed.launch.spawn` — run a function on N local ranks.
"""

from forwardkit.distributed.dp_utils import coordinate_batch_across_dp
from forwardkit.distributed.parallel_state import (
    DPCollectiveError,
    DPGroup,
    destroy_dp_group,
    get_dp_group,
    init_dp_group,
    is_dp_group_initialized,
)

__all__ = [
    "DPCollectiveError",
    "DPGroup",
    "coordinate_batch_across_dp",
    "destroy_dp_group",
    "get_dp_group",
    "init_dp_group",
    "is_dp_group_initialized",
]
