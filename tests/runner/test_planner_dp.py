"""The runner's step planner across two real DP ranks (gloo on loopback)."""

from __future__ import annotations

import pytest

from forwardkit.config.compilation import CUDAGraphMode as M
from forwardkit.config.observability import ObservabilityConfig
from forwardkit.forward_context import BatchDescriptor as d

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

# rank 0 per-request tokens, rank 1 per-request tokens (as in test_dispatcher's simulated pair)
ROWS = [([1] * 5, [1] * 3), ([1] * 5, [4, 1, 1, 7]), ([1] * 5, [10, 10])]


def _rank_main(rank: int, nprocs: int, port: int) -> list[tuple]:
    from forwardkit.config.compilation import CompilationMode
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.frozen import unfrozen
    from forwardkit.config.parallel import ParallelConfig
    from forwardkit.config.scheduler import SchedulerConfig
    from forwardkit.distributed import destroy_dp_group, init_dp_group
    from forwardkit.runner.planner import StepPlanner

    sizes = [1, 2, 4, 8, 16]
    parallel = ParallelConfig(
        data_parallel_size=nprocs, data_parallel_rank=rank, disable_nccl_for_dp_synchronization=True,
    )
    cfg = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=8), parallel_config=parallel)
    # the graph fields set to the state under test (on CPU resolution turns graphs off)
    with unfrozen(cfg):  # states resolution does not produce on the CPU
        cc = cfg.compilation_config
        cc.mode, cc.splitting_ops = CompilationMode.VLLM_COMPILE, list(cc.ATTENTION_OPS)
        cc.cudagraph_mode = M.FULL_AND_PIECEWISE
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = sizes, 16
        cc.bs_to_padded_graph_size = [0] + [min(s for s in sizes if s >= b) for b in range(1, 17)]
        cfg.observability_config = ObservabilityConfig(cudagraph_metrics=True)  # stats on
    planner = StepPlanner(cfg, M.FULL_AND_PIECEWISE)
    # ParallelConfig picks its own free master port (as vLLM's does); the ranks meet at ``port``
    init_dp_group(parallel, backend="gloo", timeout_s=60, master_addr="127.0.0.1", master_port=port)
    try:
        out = []
        for row in ROWS:
            per_req = row[rank]
            r = planner.plan(sum(per_req), len(per_req), per_req, max(per_req))
            stat = r.cudagraph_stats
            out.append((r.cudagraph_mode.name, tuple(r.batch_descriptor), False,
                        r.num_tokens_across_dp.tolist(),
                        (stat.num_unpadded_tokens, stat.num_padded_tokens, stat.num_paddings)))
        return out
    finally:
        destroy_dp_group()


def test_runner_decision_two_real_dp_ranks():
    from forwardkit.distributed.launch import spawn

    rank0, rank1 = spawn(_rank_main, 2, timeout_s=150)
    expected0 = [
        ("FULL", tuple(d(8, 8, True)), False, [8, 8], (5, 8, 3)),
        ("PIECEWISE", tuple(d(16)), False, [16, 16], (5, 16, 11)),
        ("NONE", tuple(d(20)), False, [20, 20], (5, 20, 15)),
    ]
    expected1 = [
        ("FULL", tuple(d(8, 8, True)), False, [8, 8], (3, 8, 5)),
        ("PIECEWISE", tuple(d(16)), False, [16, 16], (13, 16, 3)),
        ("NONE", tuple(d(20)), False, [20, 20], (20, 20, 0)),
    ]
    assert rank0 == expected0
    assert rank1 == expected1
