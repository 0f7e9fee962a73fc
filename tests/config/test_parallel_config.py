"""ParallelConfig: DP resolution (explicit and environment paths), validation, hash."""

from __future__ import annotations

import pytest

from forwardkit.config.parallel import ParallelConfig


def test_defaults():
    p = ParallelConfig()
    assert (p.world_size, p.world_size_across_dp, p.data_parallel_size) == (1, 1, 1)
    assert (p.data_parallel_rank, p.data_parallel_rank_local, p.data_parallel_index) == (0, 0, 0)
    assert p.data_parallel_master_ip == "127.0.0.1"
    assert p.data_parallel_master_port == 0
    assert p.distributed_executor_backend == "uni"
    assert (p.use_ubatching, p.num_ubatches, p.local_world_size) == (False, 0, 1)
    assert [p.get_next_dp_init_port(), p.get_next_dp_init_port()] == [0, 1]
    assert p.data_parallel_master_port == 2


@pytest.mark.parametrize(
    "kwargs, world, executor",
    [
        (dict(tensor_parallel_size=2, pipeline_parallel_size=2), 4, "mp"),
        (dict(tensor_parallel_size=2, prefill_context_parallel_size=2), 4, "mp"),
        (dict(tensor_parallel_size=1), 1, "uni"),
    ],
)
def test_world_size(kwargs, world, executor):
    p = ParallelConfig(**kwargs)
    assert p.world_size == world
    assert p.distributed_executor_backend == executor


def test_explicit_dp():
    p = ParallelConfig(data_parallel_size=2)
    assert (p.world_size, p.world_size_across_dp) == (1, 2)
    assert p.data_parallel_rank_local is None
    assert p.data_parallel_master_port > 0  # a random free port
    assert ParallelConfig(data_parallel_size=2, data_parallel_rank=1).data_parallel_index == 1
    q = ParallelConfig(data_parallel_size=1, data_parallel_size_local=0)  # explicit path
    assert q.data_parallel_master_port > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(data_parallel_size=2, data_parallel_rank=2), r"data_parallel_rank \(2\) must be in the range \[0, 2\)"),
        (dict(data_parallel_size=2, data_parallel_rank=-1), r"data_parallel_rank \(-1\) must be in the range \[0, 2\)"),
        (dict(data_parallel_size=2, data_parallel_size_local=3), r"data_parallel_size_local \(3\) must be <= data_parallel_size \(2\)"),
        (dict(data_parallel_external_lb=True), "data_parallel_external_lb"),
        (dict(eplb_config={"num_redundant_experts": 2}), "num_redundant_experts"),
        (dict(enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2), "only supported on CUDA"),
        (dict(all2all_backend="bogus"), "all2all_backend"),
        (dict(data_parallel_backend="slurm"), "data_parallel_backend"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
        (dict(nnodes=2, distributed_executor_backend="ray"), "nnodes=2"),
        (dict(distributed_executor_backend="threads"), "threads"),
        (dict(bogus_field=1), "bogus_field"),
    ],
)
def test_invalid(kwargs, message, cpu_platform):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_eplb_on_cuda(cuda_platform):
    p = ParallelConfig(enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2)
    assert p.enable_eplb
    with pytest.raises(ValueError, match="enable_expert_parallel must be True"):
        ParallelConfig(enable_eplb=True, tensor_parallel_size=2)


def test_dp1_rank_reset_from_env():  # DP 1 with a rank goes through the env path
    assert ParallelConfig(data_parallel_rank=5).data_parallel_rank == 0


def test_sequence_parallel_moe_and_ubatching():
    p = ParallelConfig(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True)
    assert p.use_sequence_parallel_moe
    assert (p.world_size, p.world_size_across_dp) == (2, 8)
    assert not ParallelConfig(data_parallel_size=4, tensor_parallel_size=2).use_sequence_parallel_moe
    assert not ParallelConfig(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True,
                              all2all_backend="pplx").use_sequence_parallel_moe
    dbo = ParallelConfig(enable_dbo=True)
    assert (dbo.use_ubatching, dbo.num_ubatches) == (True, 2)
    three = ParallelConfig(ubatch_size=3)
    assert (three.use_ubatching, three.num_ubatches) == (True, 3)
    one = ParallelConfig(ubatch_size=1)
    assert (one.use_ubatching, one.num_ubatches) == (False, 1)


def test_offline_dp_from_env(monkeypatch):
    monkeypatch.setenv("FORWARDKIT_DP_SIZE", "2")
    monkeypatch.setenv("FORWARDKIT_DP_RANK", "1")
    monkeypatch.setenv("FORWARDKIT_DP_MASTER_IP", "10.0.0.1")
    monkeypatch.setenv("FORWARDKIT_DP_MASTER_PORT", "1234")
    p = ParallelConfig()
    assert (p.data_parallel_size, p.data_parallel_rank, p.data_parallel_rank_local) == (2, 1, 1)
    assert (p.data_parallel_master_ip, p.data_parallel_master_port) == ("10.0.0.1", 1234)
    with pytest.raises(ValueError, match="Offline data parallel mode is not supported/useful for dense models"):
        ParallelConfig(is_moe_model=False)
    explicit = ParallelConfig(data_parallel_size=3, data_parallel_rank=2)
    assert (explicit.data_parallel_size, explicit.data_parallel_rank) == (3, 2)


def test_all2all_env_override(monkeypatch):
    monkeypatch.setenv("FORWARDKIT_ALL2ALL_BACKEND", "pplx")
    assert ParallelConfig(all2all_backend="naive").all2all_backend == "pplx"
    monkeypatch.setenv("FORWARDKIT_ALL2ALL_BACKEND", "nope")
    with pytest.raises(ValueError, match="Invalid value 'nope' for FORWARDKIT_ALL2ALL_BACKEND"):
        ParallelConfig()


def test_hash():
    base = ParallelConfig().compute_hash()
    assert ParallelConfig(data_parallel_master_ip="10.1.1.1").compute_hash() == base
    assert ParallelConfig(master_port=1).compute_hash() == base
    assert ParallelConfig(tensor_parallel_size=2).compute_hash() != base
    assert ParallelConfig(enable_dbo=True).compute_hash() != base
    assert len(base) == 64
