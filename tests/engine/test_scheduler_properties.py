"""Scheduler invariants over random workloads (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from forwardkit.engine.block_manager import BlockManager
from forwardkit.engine.request import Request
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.engine.scheduler import Scheduler


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=8),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 5),
    block_size=st.sampled_from([1, 4, 16]),
    extra_blocks=st.integers(0, 20),
    chunked=st.booleans(),
)
def test_random_workloads_finish_within_limits(lens, budget, max_seqs, block_size, extra_blocks,
                                               chunked):
    longest = max(p + m for p, m in lens)
    if not chunked:
        budget = max(budget, max(p for p, _ in lens))
    num_blocks = -(-longest // block_size) + extra_blocks
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      enable_chunked_prefill=chunked)
    reqs = [Request(str(i), [1] * p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(lens)]
    for r in reqs:
        sched.add(r)
    for _ in range(10_000):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert not out.is_empty
        assert out.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= max_seqs
        owned = [b for r in sched.running for b in r.block_ids]
        assert len(owned) == len(set(owned)) and len(owned) + bm.num_free_blocks == num_blocks
        for r, n in zip(out.requests, out.num_scheduled_tokens):
            assert len(r.block_ids) * block_size >= r.num_computed_tokens + n
            if not chunked and r.num_computed_tokens == 0 and r.num_preemptions == 0:
                assert n == r.num_prompt_tokens  # whole prompts only
        batch = out.to_batch()
        sched.update(out, {rid: 3 for rid, s in zip(batch.req_ids, batch.sample) if s})
    assert not sched.has_unfinished
    assert bm.num_free_blocks == num_blocks
    assert [len(r.output_token_ids) for r in reqs] == [m for _, m in lens]
