"""Prefix caching in the block manager and scheduler, without a model.

A fake model stands in for the runner: it writes each scheduled token into its KV slot
(block, offset) and computes the next token from what it reads back through the request's
block table, never from the request's own token list. A block shared by mistake, freed while
in use, overwritten while cached or hit with the wrong content therefore changes the tokens,
and every stream is compared against the same stream with caching off.
"""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwardkit.engine.block_hash import BlockHasher, cbor_encode
from forwardkit.engine.block_manager import BlockManager
from forwardkit.engine.request import Request, RequestStatus
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.engine.scheduler import Scheduler

VOCAB = 5


class FakeKV:
    """Slots of a paged cache holding token ids; the next token is a hash of the read-back
    context (so it depends on every cached position)."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[tuple[int, int], int] = {}
        self.prefill_tokens = 0

    def step(self, sched: Scheduler) -> tuple[object, dict[str, int]]:
        out = sched.schedule()
        bs = self.bm.block_size
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            start = req.num_computed_tokens
            self.prefill_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
            for p in range(start, start + n):
                block = req.block_ids[p // bs]
                # a computed block is never written again (shared ones are read-only)
                assert not self.bm.is_computed(block), (req, p, block)
                self.slots[(block, p % bs)] = req.token_slice(p, p + 1)[0]
        sampled = {}
        for req, n in zip(out.requests, out.num_scheduled_tokens):
            end = req.num_computed_tokens + n
            if end == req.num_tokens:
                context = [self.slots[(req.block_ids[p // bs], p % bs)] for p in range(end)]
                digest = hashlib.sha256(repr(context).encode()).digest()
                sampled[req.request_id] = digest[0] % VOCAB
        return out, sampled


def _run(streams: list[tuple[int, list[int], int, int]], aborts: dict[int, list[str]],
         num_blocks: int, block_size: int, budget: int, max_seqs: int, caching: bool,
         check: bool = True) -> tuple[dict[str, list[int]], FakeKV, BlockManager]:
    """Run ``streams`` (arrival step, prompt, max_tokens, n) to the end; ``aborts`` maps a
    step to request ids aborted before it. Returns the output tokens by request id."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    kv = FakeKV(bm)
    reqs: list[Request] = []
    aborted: set[str] = set()
    step = 0
    pending = sorted(enumerate(streams), key=lambda x: x[1][0])
    while pending or sched.has_unfinished:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens, n) = pending.pop(0)
            group = [Request(f"{i}.{k}", prompt, SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True), index=k)
                     for k in range(n)]
            sched.add_all(group)
            reqs += group
        for rid in aborts.get(step, []):
            if sched.abort(rid) is not None:
                aborted.add(rid)
        if check:
            bm.check_invariants(sched.running)
        if sched.has_unfinished:
            out, sampled = kv.step(sched)
            assert not out.is_empty
            sched.update(out, sampled)
        step += 1
        assert step < 5000
    if check:
        bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
    return {r.request_id: r.output_token_ids for r in reqs if r.request_id not in aborted}, kv, bm


def _stream(seed: int, count: int, block_size: int) -> list[tuple[int, list[int], int, int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 4 * block_size))]
                for _ in range(3)]
    out = []
    for _ in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        out.append((rng.randrange(0, 12), prompt, rng.randrange(1, 10), rng.choice([1, 1, 2, 3])))
    return out


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), count=st.integers(1, 10), block_size=st.sampled_from([1, 2, 4]),
       extra_blocks=st.integers(0, 12), budget=st.integers(3, 40), max_seqs=st.integers(1, 6),
       abort_count=st.integers(0, 3))
def test_random_streams_same_tokens_as_caching_off(seed, count, block_size, extra_blocks, budget,
                                                   max_seqs, abort_count):
    streams = _stream(seed, count, block_size)
    longest = max(len(p) + m for _, p, m, _ in streams)
    num_blocks = -(-longest // block_size) + extra_blocks  # tiny: preemption is common
    rng = random.Random(seed + 1)
    ids = [f"{i}.{k}" for i, (_, _, _, n) in enumerate(streams) for k in range(n)]
    aborts: dict[int, list[str]] = {}
    for _ in range(abort_count):
        aborts.setdefault(rng.randrange(0, 20), []).append(rng.choice(ids))
    off, _, _ = _run(streams, aborts, num_blocks, block_size, budget, max_seqs, caching=False)
    on, _, _ = _run(streams, aborts, num_blocks, block_size, budget, max_seqs, caching=True)
    for rid in set(off) & set(on):  # aborts can land at different points in the two runs
        assert on[rid] == off[rid], rid


def test_fake_model_sees_a_wrong_hit():
    """The harness can fail: a block manager that ignores the salt of a request's tokens
    (every block hashed alike) gives different tokens."""
    streams = [(0, [1, 2, 3, 4, 0], 4, 1), (3, [4, 3, 2, 1, 0], 4, 1)]
    off, _, _ = _run(streams, {}, 32, 2, 16, 4, caching=False)
    original = BlockHasher.hash_block
    try:
        BlockHasher.hash_block = lambda self, parent, tokens, extra=(): b"same"  # type: ignore
        on, _, _ = _run(streams, {}, 32, 2, 16, 4, caching=True, check=False)
    finally:
        BlockHasher.hash_block = original  # type: ignore
    assert on != off


def test_n_siblings_share_the_prompt_from_the_first_step():
    bs = 4
    prompt = list(range(1, 4)) * 10  # 30 tokens: 7 full blocks
    bm = BlockManager(64, bs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    kv = FakeKV(bm)
    group = [Request(f"{k}_0", prompt, SamplingParams(max_tokens=3, ignore_eos=True), index=k)
             for k in range(4)]
    sched.add_all(group)
    out, sampled = kv.step(sched)
    assert out.requests == group  # all four run in the first step
    # the leader computes 30 tokens; each sibling starts after the 7 shared full blocks
    assert out.num_scheduled_tokens == [30, 2, 2, 2]
    assert all(r.block_ids[:7] == group[0].block_ids[:7] for r in group)
    assert [bm.ref_count(b) for b in group[0].block_ids[:7]] == [4] * 7
    assert bm.stats.queries == 4 * 30 and bm.stats.hits == 3 * 28
    sched.update(out, sampled)
    assert [r.num_cached_tokens for r in group] == [0, 28, 28, 28]
    assert len(set(sampled.values())) == 1  # the same context gives the same next token


def test_pending_blocks_not_hit_when_micro_batching():
    bs = 4
    prompt = [1, 2, 3] * 4
    bm = BlockManager(32, bs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, allow_pending_hits=False)
    sched.add_all([Request("a", prompt, SamplingParams(max_tokens=2)),
                   Request("b", prompt, SamplingParams(max_tokens=2))])
    out = sched.schedule()
    assert out.num_scheduled_tokens == [12, 12]  # b may not read what a writes in this step
    sched.update(out, {"a": 1, "b": 1})
    sched.add(Request("c", prompt, SamplingParams(max_tokens=2)))
    out = sched.schedule()
    c = next(r for r in out.requests if r.request_id == "c")
    assert c.num_cached_tokens == 8  # computed blocks are hit (capped before the last token)


def test_hit_capped_before_the_last_token_and_lru_eviction():
    bs = 2
    bm = BlockManager(6, bs, enable_prefix_caching=True)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=1))
    bm.admit(a, [], 4)
    a.num_computed_tokens = 4
    bm.mark_computed(a)
    first, second = a.block_ids
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    # the whole prompt is cached, but its last token is recomputed for its logits
    b = Request("b", [1, 2, 3, 4], SamplingParams(max_tokens=1))
    assert bm.find_cached_prefix(b) == [first]
    c = Request("c", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert bm.find_cached_prefix(c) == [first, second]
    # plain free blocks go first; then the LRU queue, a freed prefix's tail before its head
    d = Request("d", [9] * 10, SamplingParams(max_tokens=1))
    bm.admit(d, [], 10)
    assert first not in d.block_ids and second in d.block_ids
    assert bm.find_cached_prefix(c) == [first]
    bm.check_invariants([d])


def test_uncomputed_blocks_lose_their_hash_when_freed():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    bm.admit(a, [], 5)  # registered for the step...
    assert bm.num_cached_blocks == 2
    bm.free(a)  # ...which never ran (an aborted step)
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(Request("b", [1, 2, 3, 4, 5], SamplingParams())) == []
    bm.check_invariants([])


def test_salt_and_skip_reading():
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), cache_salt="tenant-1")
    bm.admit(a, [], 5)
    a.num_computed_tokens = 5
    bm.mark_computed(a)
    same = Request("b", [1, 2, 3, 4, 5], SamplingParams(), cache_salt="tenant-1")
    other = Request("c", [1, 2, 3, 4, 5], SamplingParams(), cache_salt="tenant-2")
    none = Request("d", [1, 2, 3, 4, 5], SamplingParams())
    assert bm.find_cached_prefix(same) == a.block_ids[:2]
    assert bm.find_cached_prefix(other) == [] and bm.find_cached_prefix(none) == []
    skip = Request("e", [1, 2, 3, 4, 5], SamplingParams(skip_reading_prefix_cache=True),
                   cache_salt="tenant-1")
    assert bm.find_cached_prefix(skip) == []
    logprobs = Request("f", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=1), cache_salt="tenant-1")
    assert logprobs.skip_reading_prefix_cache and bm.find_cached_prefix(logprobs) == []
    logprobs.drop_prompt_logprobs()  # an n > 1 sibling: completion 0 computes them
    assert bm.find_cached_prefix(logprobs) == a.block_ids[:2]


def test_reset_and_invalidate():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    bm.admit(a, [], 5)
    a.num_computed_tokens = 5
    bm.mark_computed(a)
    assert bm.reset_prefix_cache() is False and bm.num_cached_blocks == 2  # a holds blocks
    bm.free(a)
    assert bm.reset_prefix_cache() is True and bm.num_cached_blocks == 0
    assert bm.num_free_blocks == 8
    b = Request("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    bm.admit(b, [], 5)
    b.num_computed_tokens = 5
    bm.mark_computed(b)
    bm.invalidate()  # held blocks too
    assert bm.find_cached_prefix(Request("c", [1, 2, 3, 4, 5], SamplingParams())) == []
    bm.free(b)
    bm.check_invariants([])


def test_preempted_request_rehits_its_own_blocks():
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=32)
    kv = FakeKV(bm)
    a = Request("a", [1, 2, 3, 4, 1], SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add(a)
    for _ in range(3):  # the prompt, then two decode steps: 7 tokens computed
        sched.update(*kv.step(sched))
    own = list(a.block_ids)
    sched._preempt(a)  # what schedule() does when the cache is full
    out, sampled = kv.step(sched)
    # back from its own 3 full blocks (6 tokens), recomputing only the 7th and the new one
    assert a.block_ids[:3] == own[:3] and out.num_scheduled_tokens == [2]
    assert (bm.stats.preempted_requests, bm.stats.preempted_queries, bm.stats.preempted_hits) \
        == (1, 8, 6)
    assert (bm.stats.requests, bm.stats.queries, bm.stats.hits) == (1, 5, 0)
    assert a.num_cached_tokens == 0  # its first admission found nothing
    sched.update(out, sampled)
    while sched.has_unfinished:
        sched.update(*kv.step(sched))
    assert len(a.output_token_ids) == 6


def test_hash_algorithms():
    tokens = [1, 2, 3, 4]
    digests = {algo: BlockHasher(algo).hash_block(None, tokens) for algo in
               ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")}
    assert len(set(digests.values())) == 4
    assert len(digests["sha256"]) == 32 and len(digests["xxhash"]) == 16
    h = BlockHasher("sha256")
    first = h.hash_block(None, tokens)
    assert h.hash_block(first, tokens) != first  # chained
    assert h.hash_block(None, tokens, ("salt",)) != first
    assert h.hash_block(None, tokens, ("a",)) != h.hash_block(None, tokens, ("b",))
    # sha256_cbor is SHA-256 of canonical CBOR: reproducible by another program
    root = BlockHasher("sha256_cbor").hash_block(None, [])  # any value; check the chain step
    expected = hashlib.sha256(b"\x83" + b"\x58\x20" + root + b"\x82\x01\x02" + b"\xf6").digest()
    assert BlockHasher("sha256_cbor").hash_block(root, [1, 2]) == expected


@pytest.mark.parametrize("value, encoded", [
    (0, b"\x00"), (23, b"\x17"), (24, b"\x18\x18"), (1000, b"\x19\x03\xe8"),
    (-1, b"\x20"), (-1000, b"\x39\x03\xe7"), (2**32, b"\x1b\x00\x00\x00\x01\x00\x00\x00\x00"),
    ("a", b"\x61\x61"), (b"", b"\x40"), ([1, [2, 3]], b"\x82\x01\x82\x02\x03"), (None, b"\xf6"),
])
def test_cbor_canonical_encoding(value, encoded):
    assert cbor_encode(value) == encoded


def test_unknown_hash_algorithm_is_refused():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='md5' is invalid.*sha256"):
        BlockHasher("md5")


def test_abort_frees_blocks_and_marks_the_request():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=32)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=2))
    sched.add_all([a, b])
    sched.schedule()
    assert sched.abort("a") is a and a.status == RequestStatus.FINISHED
    assert a.finish_reason == "abort" and a.block_ids == []
    assert sched.abort("a") is None
    bm.check_invariants(sched.running)
