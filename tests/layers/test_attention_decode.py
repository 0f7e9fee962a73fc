"""Decode length buckets: the planner's optimality and bucketed attention vs a dense reference."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from forwardkit.forward_context import set_forward_context
from forwardkit.layers.attention import Attention, build_attention_metadata
from forwardkit.layers.attention_metadata import plan_decode_buckets
from forwardkit.layers.kv_cache import bind_kv_cache

HQ, HK, D, BS = 4, 2, 8, 4


@pytest.fixture
def engine_config(decode_path_config):
    """Every test here runs with the native decode kernel and with the torch decode path."""
    return decode_path_config


def _cost(widths: list[int], ends: list[int], overhead: int) -> int:
    total, begin = 0, 0
    for end in ends:
        total += overhead + widths[end - 1] * (end - begin)
        begin = end
    return total


@pytest.mark.parametrize("seed", range(40))
def test_planner_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    widths = sorted(rng.randint(1, 12) for _ in range(rng.randint(1, 8)))
    overhead = rng.choice([0, 1, 3, 8, 100])
    ends = plan_decode_buckets(widths, overhead)
    assert ends[-1] == len(widths) and ends == sorted(set(ends))
    n = len(widths)
    best = min(
        _cost(widths, [*cuts, n], overhead)
        for r in range(n)
        for cuts in itertools.combinations(range(1, n), r)
    )
    assert _cost(widths, ends, overhead) == best


def test_planner_extremes_and_errors():
    assert plan_decode_buckets([], 8) == []
    assert plan_decode_buckets([3, 3, 3], 0) == [3]  # equal widths never split
    assert plan_decode_buckets([1, 50], 1 << 30) == [2]  # huge call cost: one bucket
    assert plan_decode_buckets([1, 50], 0) == [1, 2]
    many = sorted(random.Random(0).randint(1, 400) for _ in range(300))
    ends = plan_decode_buckets(many, 8)  # > 64 distinct widths: coarsened, still a partition
    assert ends[-1] == 300 and all(a < b for a, b in zip(ends, ends[1:]))
    with pytest.raises(ValueError, match="ascending"):
        plan_decode_buckets([3, 1], 8)


def test_buckets_partition_decode_rows():
    seq = [3, 40, 5, 17, 1, 40, 9]
    tables = [list(range(10 * i, 10 * i + -(-s // BS))) for i, s in enumerate(seq)]
    md = build_attention_metadata([1] * 7, seq, tables, 7, BS, "cpu")
    rows = torch.cat([b.rows for b in md.decode_buckets]).tolist()
    assert sorted(rows) == list(range(7))
    for b in md.decode_buckets:
        lens = [seq[r] for r in b.rows.tolist()]
        assert b.key_len == max(lens) and b.width == -(-max(lens) // BS)
        assert b.block_ids.numel() == len(lens) * b.width
        assert (b.key_mask is None) == (min(lens) == max(lens))
    fixed = build_attention_metadata([1] * 7, seq, tables, 7, BS, "cpu", max_num_blocks_per_req=12)
    assert fixed.decode_buckets is None and fixed.decode_block_table.shape == (7, 12)


def _dense_decode(q, ks, vs, scale):
    group = HQ // HK
    k = ks.double().repeat_interleave(group, dim=1)
    v = vs.double().repeat_interleave(group, dim=1)
    p = (torch.einsum("hd,khd->hk", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", p, v)


@pytest.mark.parametrize("seed", [0, 1])
def test_bucketed_decode_matches_dense_and_fixed_width(engine_config, seed):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    layer = Attention(HQ, D, D**-0.5, HK, prefix="dec.attn")
    cache = bind_kv_cache(engine_config.compilation_config.static_forward_context, 400, BS,
                          torch.float32, "cpu")["dec.attn"]
    cache.normal_(generator=gen)
    n = 24
    seq = [rng.choice([1, 2, 4, 5, 16, 17, 33, rng.randint(1, 90)]) for _ in range(n)]
    free = rng.sample(range(400), 400)
    tables = [[free.pop() for _ in range(-(-s // BS))] for s in seq]
    pad = 3
    q = torch.randn(n + pad, HQ * D, generator=gen)
    k = torch.randn(n + pad, HK * D, generator=gen)
    v = torch.randn(n + pad, HK * D, generator=gen)
    outs, mds = [], []
    for width in (None, 24):
        mds.append(build_attention_metadata([1] * n, seq, tables, n + pad, BS, "cpu", width))
        with set_forward_context({"dec.attn": mds[-1]}, engine_config):
            outs.append(layer(q, k, v).view(n + pad, HQ, D))
    bucketed, fixed = outs
    assert len(mds[0].decode_buckets) > 1 and mds[1].decode_buckets is None
    flat = cache.view(2, -1, HK, D)
    for i, (s, bt) in enumerate(zip(seq, tables)):
        slots = torch.tensor([bt[p // BS] * BS + p % BS for p in range(s)])
        want = _dense_decode(q[i].view(HQ, D), flat[0][slots], flat[1][slots], D**-0.5)
        torch.testing.assert_close(bucketed[i].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bucketed, fixed, atol=1e-6, rtol=1e-6)
    assert torch.equal(bucketed[n:], torch.zeros_like(bucketed[n:]))
