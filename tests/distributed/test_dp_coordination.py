"""coordinate_batch_across_dp: post-processing, multi-process agreement, timeouts, errors."""

from __future__ import annotations

import time

import pytest
import torch

from forwardkit.config.parallel import ParallelConfig
from forwardkit.distributed import (
    DPCollectiveError,
    coordinate_batch_across_dp,
    destroy_dp_group,
    get_dp_group,
    init_dp_group,
)
from forwardkit.distributed.dp_utils import (
    _post_process_cudagraph_mode,
    _post_process_dp_padding,
    _post_process_ubatch,
)
from forwardkit.distributed.launch import spawn


def parallel_config(dp: int, rank: int, **overrides) -> ParallelConfig:
    """DP ``dp`` with micro-batching on (DBO: two micro-batches, thresholds 32 / 512), MoE."""
    fields = dict(data_parallel_size=dp, data_parallel_rank=rank, enable_dbo=True, is_moe_model=True)
    fields.update(overrides)
    return ParallelConfig(**fields)


# --- single process --------------------------------------------------------------------------


def test_post_processing_of_gathered_votes():
    t = torch.tensor([[10, 3, 7], [16, 4, 8], [1, 1, 1], [1, 1, 1], [2, 1, 2]], dtype=torch.int32)
    assert _post_process_ubatch(t, 2) is False  # 16 // 2 = 8 >= min real 3: last ubatch empty
    padded = _post_process_dp_padding(t, True)
    assert padded.dtype == torch.int32 and padded.tolist() == [16, 16, 16]
    unpadded = _post_process_dp_padding(t, False)
    assert unpadded.dtype == torch.int32 and unpadded.tolist() == [16, 4, 8]
    assert _post_process_cudagraph_mode(t) == 1
    t2 = torch.tensor([[40, 33], [48, 40], [1, 1], [1, 1], [2, 2]], dtype=torch.int32)
    assert _post_process_ubatch(t2, 2) is True
    t2[2] = torch.tensor([1, 0])
    assert _post_process_ubatch(t2, 2) is False


def test_single_rank_short_circuits():
    out = coordinate_batch_across_dp(num_tokens_unpadded=5, allow_microbatching=True,
                                     allow_dp_padding=True,
                                     parallel_config=ParallelConfig(), cudagraph_mode=2)
    assert out == (False, None, 2)


def test_no_group_gives_clear_error():
    destroy_dp_group()
    with pytest.raises(RuntimeError, match="DP group is not initialized"):
        coordinate_batch_across_dp(5, False, True, parallel_config(2, 0))


def test_invalid_inputs():
    with pytest.raises(ValueError, match="cudagraph_mode"):
        coordinate_batch_across_dp(5, False, True, parallel_config(2, 0), cudagraph_mode=3)
    with pytest.raises(AssertionError, match="num_tokens_padded"):
        coordinate_batch_across_dp(5, False, True, parallel_config(2, 0), num_tokens_padded=4)
    with pytest.raises(AssertionError, match="uniform_decode"):
        coordinate_batch_across_dp(5, True, True, parallel_config(2, 0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"timeout_s": 0}, "timeout_s"), ({"backend": "mpi"}, "Unsupported DP backend"),
     ({"world_size": 2, "rank": 2, "master_port": 1234}, r"DP rank must be an int in \[0, 2\)"),
     ({"world_size": 2, "rank": 0, "master_port": 0}, "DP master port")],
)
def test_init_dp_group_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        init_dp_group(None, **kwargs)


# --- multi-process (gloo on loopback) ---------------------------------------------------------

# scenario -> per-rank (unpadded, padded, mode, allow_microbatching, allow_dp_padding, uniform)
SCENARIOS_3 = {
    "A": [(5, 8, 2, False, True, True), (13, 16, 1, False, True, True), (1, 1, 2, False, True, True)],
    "B": [(5, 8, 2, False, False, True), (13, 16, 1, False, False, True),
          (1, 1, 2, False, False, True)],
}
SCENARIOS_2 = {
    "C": [(40, 40, 2, True, True, True), (33, 40, 2, True, True, True)],
    "D": [(40, 40, 2, True, True, True), (20, 24, 2, True, True, True)],
    "E": [(40, 40, 0, True, False, True), (33, 40, 0, True, False, True)],
    "F": [(600, 600, 0, True, True, False), (40, 40, 2, True, True, True)],
    "G": [(5, 8, 2, False, True, True), (6, 8, 2, False, False, True)],
    "H": [(5, 8, 2, False, True, True), (600, 600, 0, False, True, False)],
    "C-cpu": [(40, 40, 2, True, True, True), (33, 40, 2, True, True, True)],
}
EXPECTED = {
    "A": [(False, [16, 16, 16], 1)] * 3,
    "B": [(False, [8, 16, 1], 1)] * 3,
    "C": [(True, [40, 40], 2)] * 2,
    "D": [(False, [40, 40], 2)] * 2,
    "E": [(True, [40, 40], 0)] * 2,
    "F": [(False, [600, 600], 0)] * 2,
    "G": ["AssertionError", (False, [8, 8], 2)],
    "H": [(False, [600, 600], 0)] * 2,
    "C-cpu": [(True, [40, 40], 2)] * 2,
}


def _run_scenarios(rank: int, nprocs: int, port: int, scenarios: dict) -> dict:
    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    group = get_dp_group()
    assert (group.rank, group.world_size, group.device.type) == (rank, nprocs, "cpu")
    results = {}
    try:
        for name, per_rank in scenarios.items():
            unpadded, padded, mode, mb, dp_pad, uniform = per_rank[rank]
            pc = parallel_config(nprocs, rank,
                                 disable_nccl_for_dp_synchronization=name.endswith("-cpu"))
            try:
                ubatch, tokens, synced = coordinate_batch_across_dp(
                    num_tokens_unpadded=unpadded, allow_microbatching=mb,
                    allow_dp_padding=dp_pad, parallel_config=pc, num_tokens_padded=padded,
                    uniform_decode=uniform, cudagraph_mode=mode,
                )
            except AssertionError:
                results[name] = "AssertionError"
                continue
            assert tokens.dtype == torch.int32 and tokens.device.type == "cpu"
            results[name] = (ubatch, tokens.tolist(), synced)
    finally:
        destroy_dp_group()
    return results


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenarios", [SCENARIOS_3, SCENARIOS_2], ids=["3-ranks", "2-ranks"])
def test_multi_process_scenarios(scenarios):
    nprocs = len(next(iter(scenarios.values())))
    per_rank = spawn(_run_scenarios, nprocs, args=(scenarios,), timeout_s=150)
    for name in scenarios:
        got = [per_rank[r][name] for r in range(nprocs)]
        assert got == EXPECTED[name], name


def _stalled_peer(rank: int, nprocs: int, port: int, mode: str) -> str:
    # The 2 s limit must bound the step's collective only, not the ranks' start-up (importing
    # torch in a fresh process can take longer than that on a loaded machine): rendezvous
    # with a generous limit, meet at a barrier, then bound the collectives by 2 s.
    init_dp_group(world_size=nprocs, rank=rank, master_port=port, timeout_s=120)
    group = get_dp_group()
    group.barrier()
    group.timeout_s = 2
    try:
        if rank == nprocs - 1:
            if mode == "stall":
                time.sleep(5)  # never joins this step's all-reduce
            return "skipped"
        try:
            coordinate_batch_across_dp(5, False, True, parallel_config(nprocs, rank))
        except DPCollectiveError as exc:
            return f"DPCollectiveError: {exc}"
        return "no error"
    finally:
        destroy_dp_group()


def _late_rendezvous(rank: int, nprocs: int, port: int) -> str:
    if rank == 1:
        return "never joined"
    try:
        init_dp_group(world_size=nprocs, rank=rank, master_port=port, timeout_s=2)
    except DPCollectiveError as exc:
        return f"DPCollectiveError: {exc}"
    return "joined"


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["stall", "exit"])
def test_missing_rank_raises_instead_of_hanging(mode):
    out = spawn(_stalled_peer, 2, args=(mode,), timeout_s=90)
    assert out[1] == "skipped"
    assert out[0].startswith("DPCollectiveError: DP all_reduce on rank 0 of 2 failed or did not "
                             "finish within 2 s")


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_rank_missing_at_rendezvous_times_out():
    out = spawn(_late_rendezvous, 2, timeout_s=90)
    assert out[1] == "never joined"
    assert out[0].startswith("DPCollectiveError: DP rendezvous at tcp://127.0.0.1:")
    assert "rank 0 of 2" in out[0]


# --- in-process, world size 1 (no spawn): group helpers, torchrun env, adopting a world -------


@pytest.fixture
def world_of_one():
    from forwardkit.distributed.launch import find_free_port

    yield find_free_port()
    destroy_dp_group()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "backend",
    ["gloo", pytest.param("nccl", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ])],
)
def test_group_helpers_world_of_one(world_of_one, backend):
    group = init_dp_group(world_size=1, rank=0, master_port=world_of_one, backend=backend,
                          timeout_s=30)
    assert get_dp_group() is group
    assert group.device.type == ("cuda" if backend == "nccl" else "cpu")
    t = torch.arange(4, dtype=torch.int32, device=group.device)
    assert group.all_reduce(t).tolist() == [0, 1, 2, 3]
    gathered = group.all_gather(torch.tensor([7], device=group.device))
    assert gathered.shape == (1, 1) and gathered.item() == 7
    cpu = group.all_reduce(torch.ones(2, dtype=torch.int32), use_cpu=True)
    assert cpu.tolist() == [1, 1]
    group.barrier()
    with pytest.raises(RuntimeError, match="already initialized"):
        init_dp_group(world_size=1, rank=0, master_port=world_of_one)


def test_torchrun_environment_is_used(world_of_one, monkeypatch):
    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(world_of_one)}.items():
        monkeypatch.setenv(name, value)
    # A config built earlier (rank 0 of 1) does not override the launcher's values.
    config = ParallelConfig()
    config.data_parallel_master_ip, config.data_parallel_master_port = "10.9.9.9", 1
    group = init_dp_group(config)
    assert (group.rank, group.world_size) == (0, 1)


def test_torchrun_world_must_match_dp_size(monkeypatch):
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="torchrun started 2 processes but data_parallel_size is 4"):
        init_dp_group(ParallelConfig(data_parallel_size=4))


def test_forwardkit_dp_env_is_used(world_of_one, monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FORWARDKIT_DP_SIZE", "1")
    monkeypatch.setenv("FORWARDKIT_DP_RANK", "0")
    monkeypatch.setenv("FORWARDKIT_DP_MASTER_PORT", str(world_of_one))
    group = init_dp_group(timeout_s=30)
    assert (group.rank, group.world_size, group.timeout_s) == (0, 1, 30)


def test_adopts_existing_world(world_of_one):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{world_of_one}", world_size=1,
                            rank=0, timeout=datetime.timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match="world size 1, but the DP size is 2"):
            init_dp_group(ParallelConfig(data_parallel_size=2))
        group = init_dp_group(ParallelConfig())
        assert group.owns_default_group is False
        destroy_dp_group()
        assert dist.is_initialized()  # the user's world is left alone
    finally:
        dist.destroy_process_group()


def test_rank_mismatch_between_config_and_group(world_of_one):
    init_dp_group(world_size=1, rank=0, master_port=world_of_one, timeout_s=30)
    with pytest.raises(ValueError, match="parallel_config says DP rank 1 of 2"):
        coordinate_batch_across_dp(5, False, True, parallel_config(2, 1))
