"""MoE layer: HF-Mixtral routing, expert slicing, and the 2-rank expert-parallel exchange."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from forwardkit.layers.fused_moe import FusedMoE, expert_slice, route_topk

E, K, H, INTER = 6, 2, 16, 24


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.2
    return w13, w2


def _naive(x, logits, w13, w2):
    """Per-token loop, as HF Mixtral describes it."""
    probs = logits.float().softmax(-1)
    top, ids = probs.topk(K, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = ids[t, j]
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t] += top[t, j] * F.linear(F.silu(gate) * up, w2[e])
    return out


def _make_layer(prefix="moe", **parallel):
    from forwardkit.config.engine import EngineConfig, set_current_engine_config
    from forwardkit.config.parallel import ParallelConfig

    config = EngineConfig(parallel_config=ParallelConfig(**parallel))
    with set_current_engine_config(config):
        layer = FusedMoE(E, K, H, INTER, prefix=prefix)
    return config, layer


def _load_per_expert(layer, w13, w2):
    for e in range(E):
        layer.weight_loader(layer.w13_weight, w13[e, :INTER], (e, "w1"))
        layer.weight_loader(layer.w13_weight, w13[e, INTER:], (e, "w3"))
        layer.weight_loader(layer.w2_weight, w2[e], (e, "w2"))


def test_expert_slice():
    assert [expert_slice(6, 2, r) for r in range(2)] == [(0, 3), (3, 3)]
    assert [expert_slice(7, 3, r) for r in range(3)] == [(0, 3), (3, 2), (5, 2)]
    with pytest.raises(ValueError, match="cannot be split"):
        expert_slice(2, 3, 0)


def test_routing_renormalises():
    w, ids = route_topk(torch.tensor([[0.0, 1.0, 2.0, -1.0]]), 2)
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w.sum(-1), torch.ones(1))


def test_single_process_matches_naive():
    from forwardkit.forward_context import set_forward_context

    config, layer = _make_layer()
    w13, w2 = _weights()
    _load_per_expert(layer, w13, w2)
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(9, H, generator=gen), torch.randn(9, E, generator=gen)
    with set_forward_context(None, config):
        got = layer(x, logits)
    torch.testing.assert_close(got, _naive(x, logits, w13, w2), atol=1e-5, rtol=1e-5)


def test_dense_form_matches_sparse():
    """The fixed-shape form used under CUDA-graph capture gives the same result."""
    _, layer = _make_layer(data_parallel_size=2, data_parallel_rank=1, enable_expert_parallel=True)
    _load_per_expert(layer, *_weights())
    gen = torch.Generator().manual_seed(3)
    x, logits = torch.randn(11, H, generator=gen), torch.randn(11, E, generator=gen)
    sparse = layer.compute_local(x, logits, dense=False)
    dense = layer.compute_local(x, logits, dense=True)
    assert sparse.abs().sum() > 0
    torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)


def test_expert_parallel_rank_loads_only_its_slice():
    _, layer = _make_layer(data_parallel_size=2, data_parallel_rank=1, enable_expert_parallel=True)
    w13, w2 = _weights()
    _load_per_expert(layer, w13, w2)
    assert layer.w13_weight.shape[0] == 3
    assert torch.equal(layer.w13_weight, w13[3:]) and torch.equal(layer.w2_weight, w2[3:])
    layer.weight_loader(layer.w2_weight, torch.zeros(E, H, INTER), "w2")  # stacked form
    assert torch.equal(layer.w2_weight, torch.zeros(3, H, INTER))


# Per step: the tokens each rank holds (rank 1 has no work in step 0 and runs a 1-row dummy).
_STEPS = [(7, 0), (2, 5), (4, 4)]


def _ep_rank(rank: int, world: int, port: int, chunks: tuple[int, ...]) -> list[float]:
    from forwardkit.distributed import destroy_dp_group, init_dp_group

    init_dp_group(world_size=world, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        config, layer = _make_layer(data_parallel_size=world, data_parallel_rank=rank, enable_expert_parallel=True)
        w13, w2 = _weights()
        _load_per_expert(layer, w13, w2)
        errors = []
        for chunk in chunks:
            os.environ["FORWARDKIT_MOE_DP_CHUNK_SIZE"] = str(chunk)
            errors += _run_steps(rank, config, layer, w13, w2)
        return errors
    finally:
        destroy_dp_group()


def _run_steps(rank, config, layer, w13, w2) -> list[float]:
    from forwardkit.forward_context import set_forward_context

    errors = []
    for step, counts in enumerate(_STEPS):
        rows = [max(n, 1) for n in counts]  # a rank with no work runs a dummy row
        gen = torch.Generator().manual_seed(100 + step)
        data = [(torch.randn(n, H, generator=gen), torch.randn(n, E, generator=gen)) for n in rows]
        x, logits = data[rank]
        across = torch.tensor(rows, dtype=torch.int32)
        with set_forward_context(None, config, num_tokens=rows[rank], num_tokens_across_dp=across):
            got = layer(x, logits)
        assert got.shape == x.shape
        if counts[rank]:
            errors.append((got - _naive(x, logits, w13, w2)).abs().max().item())
    return errors


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_rank_expert_parallel_matches_single_process():
    """Chunk size 2 forces several exchanges per step; 256 takes the single-exchange path."""
    from forwardkit.distributed.launch import spawn

    errors = spawn(_ep_rank, 2, args=((2, 256),), timeout_s=180)
    flat = [e for per_rank in errors for e in per_rank]
    assert len(flat) == 10  # every real (non-dummy) step of both ranks was checked
    assert max(flat) < 1e-5, errors
