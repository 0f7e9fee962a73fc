"""Scheduler and block manager: budgets, max_num_seqs, chunked prefill, block accounting, preemption."""

from __future__ import annotations

import pytest

from forwardkit.engine.block_manager import BlockManager, blocks_for
from forwardkit.engine.request import Request, RequestStatus
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.engine.scheduler import Scheduler


def _req(rid: str, n: int, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens, **kw))


def _run_to_completion(sched: Scheduler, token: int = 7, max_steps: int = 500):
    """Drive the scheduler with a fake model that always samples ``token``; return step plans."""
    plans, finished = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return plans, finished
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled with unfinished requests"
        batch = out.to_batch()
        plans.append(list(zip([r.request_id for r in out.requests], out.num_scheduled_tokens)))
        sampled = {rid: token for rid, s in zip(batch.req_ids, batch.sample) if s}
        finished += sched.update(out, sampled)
    raise AssertionError("did not finish")


def test_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_block_manager_allocate_and_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    r = _req("a", 6)
    assert bm.num_blocks_to_grow(r, 6) == 2
    bm.allocate(r, 6)
    assert len(r.block_ids) == 2 and bm.num_free_blocks == 2
    r.num_computed_tokens = 6
    assert bm.num_blocks_to_grow(r, 2) == 0  # 8 tokens still fit in 2 blocks
    assert bm.num_blocks_to_grow(r, 3) == 1
    big = _req("b", 20)
    assert not bm.can_allocate(big, 20)
    with pytest.raises(RuntimeError, match="'b' needs 5 more blocks, 2 free of 4"):
        bm.allocate(big, 20)
    assert big.block_ids == [] and bm.num_free_blocks == 2
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 4


@pytest.mark.parametrize("bad", [0, -1])
def test_block_manager_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(bad, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, bad)


def test_token_budget_and_chunked_prefill():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    for rid, n in (("a", 7), ("b", 12), ("c", 3)):
        sched.add(_req(rid, n))
    plans, finished = _run_to_completion(sched)
    for plan in plans:
        assert sum(n for _, n in plan) <= 10
    # Step 1: a whole (7) + first 3 tokens of b; step 2: a decodes, b continues with 9.
    assert plans[0] == [("a", 7), ("b", 3)]
    assert plans[1] == [("a", 1), ("b", 9)]
    assert plans[2] == [("a", 1), ("b", 1), ("c", 3)]
    assert sorted(r.request_id for r in finished) == ["a", "b", "c"]
    assert all(len(r.output_token_ids) == 4 and r.finish_reason == "length" for r in finished)
    assert sched.block_manager.num_free_blocks == 64


def test_partial_prefill_does_not_sample():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=4)
    sched.add(_req("a", 10))
    out = sched.schedule()
    batch = out.to_batch()
    assert batch.token_ids == [[1, 2, 3, 4]] and batch.sample == [False]
    sched.update(out, {})
    out = sched.schedule()
    batch = out.to_batch()
    assert batch.num_computed_tokens == [4] and batch.token_ids == [[5, 6, 7, 8]]
    assert batch.block_tables == [out.requests[0].block_ids] and len(batch.block_tables[0]) == 2


def test_max_num_seqs_respected():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        sched.add(_req(f"r{i}", 3, max_tokens=3))
    plans, finished = _run_to_completion(sched)
    assert max(len(p) for p in plans) == 2
    assert len(finished) == 5
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_off_schedules_whole_prompts():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10,
                      enable_chunked_prefill=False)
    sched.add(_req("a", 6))
    sched.add(_req("b", 6))
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)] == [("a", 6)]
    with pytest.raises(ValueError, match="'long'.*chunked prefill is disabled"):
        sched.add(_req("long", 11))


def test_too_long_prompt_errors_name_the_request():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=2, max_num_batched_tokens=8, max_model_len=12)
    with pytest.raises(ValueError, match="request 'p': prompt has 12 tokens but max_model_len is 12"):
        sched.add(Request("p", list(range(12)), SamplingParams(), max_model_len=12))
    with pytest.raises(ValueError, match="request 'q'.*whole cache holds 16"):
        sched.add(Request("q", list(range(10)), SamplingParams(max_tokens=10)))
    assert not sched.has_unfinished


def test_add_all_checks_each_request_once_and_queues_all_or_none(monkeypatch):
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=8, max_model_len=12)
    checked = []
    original = Scheduler.check_fits
    monkeypatch.setattr(Scheduler, "check_fits", lambda self, r: (checked.append(r.request_id),
                                                                  original(self, r))[1])
    with pytest.raises(ValueError, match="request 'p'"):
        sched.add_all([_req("a", 3), Request("p", list(range(12)), SamplingParams(), max_model_len=12)])
    assert not sched.has_unfinished  # nothing half-queued
    checked.clear()
    sched.add_all([_req("a", 3), _req("b", 2)])
    assert checked == ["a", "b"] and [r.request_id for r in sched.waiting] == ["a", "b"]


def test_full_cache_preempts_instead_of_deadlocking():
    # 6 blocks of 2 = 12 slots; three requests of 2 prompt + 4 output tokens = 18 slots in all.
    sched = Scheduler(BlockManager(6, 2), max_num_seqs=3, max_num_batched_tokens=16)
    reqs = [_req(f"r{i}", 2, max_tokens=4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plans, finished = _run_to_completion(sched)
    assert len(finished) == 3
    assert sum(r.num_preemptions for r in reqs) >= 1
    assert all(r.output_token_ids == [7, 7, 7, 7] for r in reqs)
    assert sched.block_manager.num_free_blocks == 6
    # A preempted request is recomputed: its prompt and earlier outputs are re-run.
    assert any(n > 2 for plan in plans for _, n in plan)


def test_stop_tokens_and_eos():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=32)
    a = Request("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[5]))
    b = Request("b", [1, 2], SamplingParams(max_tokens=10), eos_token_id=5)
    c = Request("c", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=5)
    d = Request("d", [1, 2], SamplingParams(max_tokens=10, min_tokens=2), eos_token_id=5)
    for r in (a, b, c, d):
        sched.add(r)
    _run_to_completion(sched, token=5)
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([5], "stop", 5)
    assert (b.output_token_ids, b.finish_reason, b.stop_reason) == ([5], "stop", None)
    assert (c.output_token_ids, c.finish_reason) == ([5, 5, 5], "length")
    assert (d.output_token_ids, d.finish_reason) == ([5, 5], "stop")
    assert all(r.status == RequestStatus.FINISHED for r in (a, b, c, d))


def test_max_model_len_caps_output():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=6)
    r = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=None), max_model_len=6)
    sched.add(r)
    _run_to_completion(sched)
    assert len(r.output_token_ids) == 2 and r.finish_reason == "length"


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="'x' has an empty prompt"):
        Request("x", [], SamplingParams())
