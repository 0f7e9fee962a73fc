"""set_forward_context builds DPMetadata across real DP ranks."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.config.parallel import ParallelConfig
from forwardkit.distributed import destroy_dp_group, init_dp_group
from forwardkit.distributed.launch import spawn
from forwardkit.forward_context import get_forward_context, set_forward_context

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

NUM_TOKENS = [3, 10, 7]


def _config(dp: int, rank: int) -> EngineConfig:
    return EngineConfig(parallel_config=ParallelConfig(data_parallel_size=dp, data_parallel_rank=rank,
                                                       is_moe_model=True))


def _describe(dp_metadata) -> tuple | None:
    if dp_metadata is None:
        return None
    counts = dp_metadata.num_tokens_across_dp_cpu
    return (counts.tolist(), str(counts.dtype), int(dp_metadata.max_tokens_across_dp_cpu),
            dp_metadata.local_sizes)


def _steps(rank: int, nprocs: int, port: int) -> dict:
    cfg = _config(nprocs, rank)
    init_dp_group(cfg.parallel_config, master_port=port, timeout_s=60)
    out = {}
    try:
        n = NUM_TOKENS[rank]
        # 1. No counts given: one all-reduce (no padding) inside set_forward_context.
        with set_forward_context({}, cfg, num_tokens=n):
            out["coordinated"] = _describe(get_forward_context().dp_metadata)
        # 2. Counts given by the runner (after coordinate_batch_across_dp): no communication.
        with set_forward_context({}, cfg, num_tokens=16,
                                 num_tokens_across_dp=torch.full((nprocs,), 16, dtype=torch.int32),
                                 cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE):
            ctx = get_forward_context()
            out["given"] = _describe(ctx.dp_metadata)
            out["descriptor"] = tuple(ctx.batch_descriptor)
        # 3. Neither attention metadata nor num_tokens: no DP metadata, no collective.
        with set_forward_context(None, cfg):
            out["none"] = _describe(get_forward_context().dp_metadata)
        # 4. Profile run without attention metadata but with num_tokens: still coordinated.
        with set_forward_context(None, cfg, num_tokens=n + 1):
            out["profile"] = _describe(get_forward_context().dp_metadata)
    finally:
        destroy_dp_group()
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_set_forward_context_builds_dp_metadata(nprocs):
    results = spawn(_steps, nprocs, timeout_s=150)
    counts = NUM_TOKENS[:nprocs]
    for out in results:
        assert out["coordinated"] == (counts, "torch.int32", max(counts), None)
        assert out["given"] == ([16] * nprocs, "torch.int32", 16, None)
        assert out["descriptor"] == (16, None, False, False)
        assert out["none"] is None
        assert out["profile"] == ([c + 1 for c in counts], "torch.int32", max(counts) + 1, None)
