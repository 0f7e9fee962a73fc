"""Data and tensor parallelism on ``torch.distributed``: process groups, batch coordination,
collectives as torch ops, a launcher.

* :func:`init_dp_group` / :func:`init_distributed` / :func:`get_dp_group` /
  :func:`get_tp_group` / :func:`get_ep_group` / :func:`destroy_dp_group` — the DP, TP and EP
  process groups (gloo CPU group + device group), every collective bounded by a timeout.
* :mod:`forwardkit.distributed.communication_op` — all-reduce, all-gather, reduce-scatter as
  registered torch ops for model code (kept as nodes in compiled graphs).
* :func:`coordinate_batch_across_dp` — the per-step all-reduce that makes DP ranks agree on
  padding, micro-batching and CUDA-graph mode.
* :func:`forwardkit.distributed.launch.spawn` — run a function on N local ranks.
"""

from forwardkit.distributed.dp_utils import coordinate_batch_across_dp
from forwardkit.distributed.parallel_state import (
    DPCollectiveError,
    DPGroup,
    RankGroup,
    destroy_distributed,
    destroy_dp_group,
    get_dp_group,
    get_ep_group,
    get_tp_group,
    get_world_group,
    init_distributed,
    init_dp_group,
    is_dp_group_initialized,
)

__all__ = [
    "DPCollectiveError",
    "DPGroup",
    "RankGroup",
    "coordinate_batch_across_dp",
    "destroy_distributed",
    "destroy_dp_group",
    "get_dp_group",
    "get_ep_group",
    "get_tp_group",
    "get_world_group",
    "init_distributed",
    "init_dp_group",
    "is_dp_group_initialized",
]
