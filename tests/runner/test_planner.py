"""StepPlanner: uniform-decode detection, padding, DP agreement and runtime mode per step."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.compilation import CompilationMode, CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.config.frozen import unfrozen
from forwardkit.config.observability import ObservabilityConfig
from forwardkit.config.parallel import ParallelConfig
from forwardkit.config.scheduler import SchedulerConfig
from forwardkit.cudagraph.metrics import CUDAGraphStat
from forwardkit.forward_context import BatchDescriptor as d
from forwardkit.platforms import CudaPlatform
from forwardkit.runner.planner import StepPlanner, is_uniform_decode

M = CUDAGraphMode
SIZES = [1, 2, 4, 8, 16]


def make_cfg(mode=M.FULL_AND_PIECEWISE, metrics=False, dp_size=1, dp_rank=0, tp=1, enable_sp=False,
             **parallel):
    """A real engine config (current platform), then the graph fields the planner reads set to
    the state under test (resolution would derive them from the platform)."""
    cfg = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=8),
        parallel_config=ParallelConfig(data_parallel_size=dp_size, data_parallel_rank=dp_rank,
                                       tensor_parallel_size=tp, **parallel),
    )
    with unfrozen(cfg):  # states resolution does not produce on this platform
        cc = cfg.compilation_config
        cc.mode = CompilationMode.VLLM_COMPILE
        cc.splitting_ops = list(cc.ATTENTION_OPS)  # attention compiled piecewise
        cc.cudagraph_mode = mode
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = list(SIZES), 16
        cc.bs_to_padded_graph_size = [0] + [min(s for s in SIZES if s >= b) for b in range(1, 17)]
        cc.pass_config.enable_sp = enable_sp
        if metrics:
            cfg.observability_config = ObservabilityConfig(cudagraph_metrics=True)
    return cfg


def planner_for(mode=M.FULL_AND_PIECEWISE, coordinate_fn=None, **kw) -> StepPlanner:
    return StepPlanner(make_cfg(mode=mode, **kw), mode, coordinate_fn)


def plan(planner: StepPlanner, per_req: list[int], **kw):
    return planner.plan(sum(per_req), len(per_req), per_req, max(per_req), **kw)


# ---- uniform decode ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, 1, 8, 8), True), ((1, 1, 7, 8), False), ((3, 3, 12, 4), True), ((3, 3, 11, 4), False),
        ((2, 1, 8, 4), False), ((5, 1, 5, 1), False), ((1, 1, 1, 1), True),
    ],
)
def test_e33_is_uniform_decode(args, expected):
    assert is_uniform_decode(*args) is expected


# ---- one rank ------------------------------------------------------------------------------
ONE_RANK_CASES = [
    ([1] * 5, {}, M.FULL, d(8, 8, True), (5, 8, 3)),
    ([4, 1, 1, 7], {}, M.PIECEWISE, d(16), (13, 16, 3)),
    ([1] * 10, {}, M.PIECEWISE, d(16), (10, 16, 6)),
    ([10, 10], {}, M.NONE, d(20), (20, 20, 0)),
    ([1] * 5, {"force_eager": True}, M.NONE, d(5), (5, 5, 0)),
    ([1] * 5, {"force_uniform_decode": False}, M.PIECEWISE, d(8), (5, 8, 3)),
    ([1, 1, 2], {"force_uniform_decode": True}, M.FULL, d(4, 4, True), (4, 4, 0)),
    ([1] * 5, {"pad_to": 12}, M.NONE, d(12), (5, 12, 7)),
]


@pytest.mark.parametrize(("per_req", "kw", "mode", "desc", "stat"), ONE_RANK_CASES)
def test_e34_single_rank(per_req, kw, mode, desc, stat):
    out = plan(planner_for(metrics=True), per_req, **kw)
    assert (out.cudagraph_mode, out.batch_descriptor) == (mode, desc)
    assert out.num_tokens_across_dp is None
    assert out.cudagraph_stats == CUDAGraphStat(*stat, str(mode))


def test_stats_only_with_metrics_on():
    assert plan(planner_for(metrics=False), [1] * 5).cudagraph_stats is None


def test_sequence_parallel_pads_to_tp_multiple():
    out = plan(planner_for(mode=M.NONE, tp=4, enable_sp=True), [2, 3])
    assert (out.cudagraph_mode, out.batch_descriptor) == (M.NONE, d(8))


def test_mode_is_fixed_and_read_only():
    planner = planner_for(M.PIECEWISE)
    assert planner.cudagraph_mode == M.PIECEWISE
    with pytest.raises(AttributeError):
        planner.cudagraph_mode = M.NONE
    with pytest.raises(RuntimeError, match="fixed once at start-up"):
        planner.dispatcher.initialize_cudagraph_keys(M.FULL)
    assert plan(planner, [1] * 3).cudagraph_mode == M.PIECEWISE


# ---- two DP ranks (the all-reduce simulated: max padded count, min mode) ----------------------
def simulate_two_ranks(per_req_0: list[int], per_req_1: list[int]):
    """Plan on both ranks; a fake coordinator plays the all-reduce with both inputs."""
    local = {}
    for rank, per_req in ((0, per_req_0), (1, per_req_1)):
        out = plan(planner_for(metrics=True), per_req)
        local[rank] = (out.batch_descriptor.num_tokens, out.cudagraph_mode.value)
    padded = max(n for n, _ in local.values())
    synced = min(m for _, m in local.values())
    results, calls = [], []

    def coordinate(**kw):
        calls.append(kw)
        return False, torch.tensor([padded, padded], dtype=torch.int32), synced

    for rank, per_req in ((0, per_req_0), (1, per_req_1)):
        planner = planner_for(metrics=True, dp_size=2, dp_rank=rank, coordinate_fn=coordinate)
        results.append(plan(planner, per_req))
    return results, calls


@pytest.mark.parametrize(
    ("r0", "r1", "across", "res0", "res1"),
    [
        ([1] * 5, [1] * 3, [8, 8], (M.FULL, d(8, 8, True), (5, 8, 3)), (M.FULL, d(8, 8, True), (3, 8, 5))),
        ([1] * 5, [4, 1, 1, 7], [16, 16], (M.PIECEWISE, d(16), (5, 16, 11)), (M.PIECEWISE, d(16), (13, 16, 3))),
        ([1] * 5, [10, 10], [20, 20], (M.NONE, d(20), (5, 20, 15)), (M.NONE, d(20), (20, 20, 0))),
    ],
)
def test_e35_two_dp_ranks(r0, r1, across, res0, res1):
    results, calls = simulate_two_ranks(r0, r1)
    for out, (mode, desc, stat) in zip(results, (res0, res1)):
        assert out.num_tokens_across_dp.tolist() == across
        assert (out.cudagraph_mode, out.batch_descriptor) == (mode, desc)
        assert out.cudagraph_stats == CUDAGraphStat(*stat, str(mode))
    assert calls[0]["num_tokens_unpadded"] == sum(r0)
    assert calls[0]["allow_dp_padding"] is True
    assert calls[0]["allow_microbatching"] is False
    assert calls[0]["parallel_config"].data_parallel_rank == 0


def test_dp_no_padding_when_graphs_off():
    calls = []

    def coordinate(**kw):
        calls.append(kw)
        return False, torch.tensor([5, 3], dtype=torch.int32), 0

    out = plan(planner_for(mode=M.NONE, dp_size=2, dp_rank=1, coordinate_fn=coordinate), [1] * 3)
    assert calls[0]["allow_dp_padding"] is False
    assert (out.cudagraph_mode, out.batch_descriptor) == (M.NONE, d(3))


def test_real_config_e34_decisions():
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig
    from forwardkit.config.scheduler import SchedulerConfig

    cfg = EngineConfig(model_config=ModelConfig(), scheduler_config=SchedulerConfig(max_num_seqs=8),
                       platform=CudaPlatform(device_capability=90))
    planner = StepPlanner(cfg, M.FULL_AND_PIECEWISE)
    for per_req, kw, mode, desc, _ in ONE_RANK_CASES:
        out = plan(planner, per_req, **kw)
        assert (out.cudagraph_mode, out.batch_descriptor) == (mode, desc), (per_req, kw)
        assert out.cudagraph_stats is None  # observability_config.cudagraph_metrics defaults to off


def test_dp_padding_follows_the_configured_mode_even_when_this_rank_runs_eagerly():
    """vLLM's rule: the config asks for graphs -> ranks pad to one count, even where the runner
    resolved NONE (no GPU here), so every rank runs the same shapes."""
    calls = []

    def coordinate(**kw):
        calls.append(kw)
        return False, torch.tensor([8, 8], dtype=torch.int32), 0

    planner = StepPlanner(make_cfg(mode=M.FULL_DECODE_ONLY, dp_size=2, dp_rank=0), M.NONE, coordinate)
    out = plan(planner, [1] * 3)
    assert calls[0]["allow_dp_padding"] is True
    assert (out.cudagraph_mode, out.batch_descriptor) == (M.NONE, d(8))


@pytest.mark.parametrize("synced, expected", [
    (M.FULL, (M.FULL, d(4, 4, True))),       # every rank can replay the FULL graph
    (M.PIECEWISE, (M.PIECEWISE, d(4))),      # a peer can only run PIECEWISE: no FULL here
    (M.NONE, (M.PIECEWISE, d(4))),           # a peer runs eagerly: FULL still off
])
def test_full_graphs_blocked_when_a_dp_peer_can_only_run_piecewise(synced, expected):
    """This rank alone would replay FULL (a uniform decode of 3 -> 4 tokens); the DP vote's
    minimum mode decides whether it still may: FULL only when every rank chose FULL."""
    alone = plan(planner_for(), [1] * 3)
    assert (alone.cudagraph_mode, alone.batch_descriptor) == (M.FULL, d(4, 4, True))

    def coordinate(**kw):
        return False, torch.tensor([4, 4], dtype=torch.int32), synced.value

    out = plan(planner_for(dp_size=2, dp_rank=0, coordinate_fn=coordinate), [1] * 3)
    assert (out.cudagraph_mode, out.batch_descriptor) == expected


def test_microbatched_full_step_without_a_microbatched_graph_is_planned_eager():
    """Micro-batched FULL graphs exist for the uniform-decode capture sizes at or above the
    decode threshold whose last micro-batch holds a real token (max_num_seqs 8: 4 and 8; 16
    would leave micro-batch 2 empty). A step the DP vote micro-batches at another FULL size
    is planned NONE (the runner never patches the mode)."""
    dbo = dict(enable_dbo=True, all2all_backend="allgather_reducescatter",
               dbo_decode_token_threshold=4)
    agreed = {}

    def coordinate(**kw):
        n = kw["num_tokens_padded"]
        return True, torch.tensor([n, n], dtype=torch.int32), agreed.get("mode", kw["cudagraph_mode"])

    planner = planner_for(mode=M.FULL_DECODE_ONLY, dp_size=2, dp_rank=0, coordinate_fn=coordinate,
                          **dbo)
    assert [x.num_tokens for x in planner.microbatched_capture_descs()] == [8, 4]
    out = plan(planner, [1] * 8)
    assert (out.cudagraph_mode, out.should_ubatch) == (M.FULL, True)
    out = plan(planner, [1] * 2)  # FULL graph of 2 exists, its micro-batched graph does not
    assert (out.cudagraph_mode, out.should_ubatch, out.batch_descriptor.num_tokens) == (M.NONE, True, 2)
    # without micro-batching configured there are none
    assert planner_for(mode=M.FULL_DECODE_ONLY).microbatched_capture_descs() == []
