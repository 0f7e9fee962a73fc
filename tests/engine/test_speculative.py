"""Speculative decoding with n-gram drafts: the tokens of plain decoding (greedy), the target's
distribution (random sampling, a chi-square test on a tiny vocabulary), limits and stops in
the middle of an accepted run, metrics and bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams
from forwardkit.engine.request import Request
from forwardkit.engine.sampler import Sampler
from forwardkit.engine.speculative import NgramProposer, SpecDecodeStats, ngram_lookup, verify

SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# repetitive prompts: random tiny models fall into loops that the lookup catches
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 8, 9, 5, 6, 7], [100, 101, 102], [7] * 5]
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
              enforce_eager=True)


def _engine(path: str, spec: bool, **kw) -> LLM:
    return LLM(path, **{**ENGINE, **kw}, **({"speculative_config": SPEC} if spec else {}))


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 6, "max_num_seqs": 4},  # chunked prefill; the budget cuts drafts
    {"num_gpu_blocks": 14, "block_size": 4},  # forced preemption
    {"enable_prefix_caching": False},
], ids=["eager", "budget", "preemption", "no-prefix-cache"])
def test_greedy_tokens_identical_with_ngram_drafts(make_checkpoint, kw):
    path = make_checkpoint("llama_gqa_tied")
    want = _tokens(_engine(path, False, **kw), GREEDY)
    spec = _engine(path, True, **kw)
    assert _tokens(spec, GREEDY) == want
    accepted = _metric(spec, "vllm:spec_decode_num_accepted_tokens")
    assert accepted > 0 and _metric(spec, "vllm:spec_decode_num_draft_tokens") >= accepted
    if "num_gpu_blocks" in kw:
        assert _metric(spec, "vllm:num_preemptions") > 0


def test_compiled_mode3(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    want = _tokens(_engine(path, False), GREEDY)
    spec = _engine(path, True, enforce_eager=False, compilation_config={"mode": 3})
    assert _tokens(spec, GREEDY) == want
    assert _metric(spec, "vllm:spec_decode_num_accepted_tokens") > 0


def test_limits_and_stops_cut_an_accepted_run(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    base, spec = _engine(path, False), _engine(path, True)
    full = _tokens(base, GREEDY)
    for max_tokens in range(1, 14):  # every cut point, inside and between runs
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert _tokens(spec, p) == [t[:max_tokens] for t in full], max_tokens
    # a stop token in the middle of an accepted run ends the output there
    stop = full[0][9]
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    assert _tokens(spec, p) == _tokens(base, p)
    # max_model_len: drafts never run past it
    short = dict(max_model_len=24)
    assert _tokens(_engine(path, True, **short), GREEDY) == _tokens(_engine(path, False, **short),
                                                                    GREEDY)


def test_penalties_logprobs_and_n(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    base, spec = _engine(path, False), _engine(path, True)
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.2, n=2, logprobs=3, min_tokens=5)
    a = base.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
    b = spec.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            for dx, dy in zip(cx.logprobs, cy.logprobs):  # from the target, per emitted token
                assert dx.keys() == dy.keys()
                assert all(abs(dx[t].logprob - dy[t].logprob) < 1e-4 for t in dx)
            assert abs(cx.cumulative_logprob - cy.cumulative_logprob) < 1e-3
    assert _metric(spec, "vllm:spec_decode_num_drafts") > 0


def test_metrics_names_and_per_position_counts(make_checkpoint):
    spec = _engine(make_checkpoint("llama_gqa_tied"), True)
    _tokens(spec, GREEDY)
    metrics = {m.name: m for m in spec.get_metrics()}
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos.values) == 4 and sum(per_pos.values) == \
        metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert per_pos.values == sorted(per_pos.values, reverse=True)  # position i needs i - 1
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    mean = metrics["forwardkit:spec_decode_mean_accepted_length"].value
    assert mean == pytest.approx(1 + sum(per_pos.values) / drafts)
    plain = _engine(make_checkpoint("llama_gqa_tied"), False)
    assert not any("spec_decode" in m.name for m in plain.get_metrics())


@pytest.mark.parametrize("spec, match", [
    ({"method": "eagle"}, "speculative_config.method='eagle' is not supported by the forwardkit "
                          "engine; accepted: 'ngram', 'draft_model'"),
    ({"method": "nope"}, "speculative_config.method='nope' is invalid"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1, got 0"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 is invalid"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size=0 is invalid"),
    ("ngram", "speculative_config must be a SpeculativeConfig, a dict"),
])
def test_bad_settings_fail_at_config_time(make_checkpoint, spec, match):
    with pytest.raises(ValueError, match=match):
        LLM(make_checkpoint("llama_gqa_tied"), speculative_config=spec, **ENGINE)


def test_disable_by_batch_size(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    llm = LLM(path, speculative_config={**SPEC, "disable_by_batch_size": 2}, **ENGINE)
    _tokens(llm, GREEDY)  # 4 requests: no drafts until only 2 are left
    _tokens(llm, GREEDY, prompts=PROMPTS[:2])
    two = _metric(llm, "vllm:spec_decode_num_drafts")
    assert two > 0
    llm2 = LLM(path, speculative_config={**SPEC, "disable_by_batch_size": 1}, **ENGINE)
    _tokens(llm2, GREEDY, prompts=PROMPTS[:2])
    assert _metric(llm2, "vllm:spec_decode_num_drafts") == 0


# ---------------------------------------------------------------------------- the proposer
@pytest.mark.parametrize("tokens, lo, hi, k, want", [
    ([1, 2, 3, 1, 2], 1, 3, 3, [3, 1, 2]),  # "1 2" occurred at 0: what followed
    ([1, 2, 3, 9, 2], 1, 3, 2, [3, 9]),  # only "2" matches (n=1)
    ([1, 2, 3, 9, 2], 2, 3, 2, []),  # no match of length >= 2
    ([5, 1, 5, 2, 5], 1, 1, 1, [2]),  # the rightmost earlier occurrence wins
    ([4, 4, 4, 4], 1, 2, 5, [4, 4, 4, 4, 4]),  # a loop: the continuation repeats it
    ([8, 1, 2, 1, 2], 2, 2, 5, [1, 2, 1, 2, 1]),  # period 2, past the end of the tokens
    ([7], 1, 3, 2, []),
])
def test_ngram_lookup(tokens, lo, hi, k, want):
    assert ngram_lookup(tokens, lo, hi, k) == want


def test_proposer_respects_max_model_len_and_max_tokens():
    from forwardkit.config.scheduler import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2)
    req = Request("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=3))
    req.output_token_ids = [2]
    assert NgramProposer(spec, 100).propose(req) == [1]  # 2 of 3 generated: room for 1 draft
    req = Request("b", [1, 2, 1, 2, 1], SamplingParams(max_tokens=50))
    req.output_token_ids = [2]
    assert NgramProposer(spec, 8).propose(req) == [1, 2]  # positions 6, 7 are the last
    req = Request("c", [1, 2, 1, 2, 1], SamplingParams(max_tokens=50), max_model_len=8)
    req.output_token_ids = [2]  # may emit 2 more tokens: 1 draft + the bonus
    assert NgramProposer(spec, 8).propose(req) == [1]


# ---------------------------------------------------------------------------- exact sampling
def _chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Upper tail of Pearson's chi-square statistic (Wilson-Hilferty approximation)."""
    n = sum(counts)
    cells = [(c, p * n) for c, p in zip(counts, probs) if p > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.9, repetition_penalty=1.5, presence_penalty=2.0),
], ids=["t1", "t0.7-topk", "t1.3-topp-penalties"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Drafts that are often wrong; the first emitted token must follow the target's row 0, the
    second (when the first draft was accepted) row 1, as plain sampling would."""
    torch.manual_seed(0)
    vocab, trials = 6, 12_000
    logits = torch.randn(3, vocab) * 1.5
    sampler = Sampler()
    req = Request("r", [0, 1], params, generator=torch.Generator().manual_seed(1234))
    req.output_token_ids = [3]
    p0, _ = sampler.target_distribution(logits[0:1], req)
    # the first draft is likely (accepted often: the second position gets samples), the
    # second one is not; the penalties see the first draft as generated at row 1
    drafts = [int(p0.argmax()), int(torch.softmax(logits[1], -1).argmin())]
    req.output_token_ids = [3, drafts[0]]
    p1, _ = sampler.target_distribution(logits[1:2], req)
    req.output_token_ids = [3]
    first, second = [0] * vocab, [0] * vocab
    for _ in range(trials):
        emitted, _ = verify(sampler, logits, req, drafts)
        assert req.output_token_ids == [3]  # verify leaves the request as it was
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            second[emitted[1]] += 1
    assert _chi_square_p(first, p0.tolist()) > 1e-3
    assert _chi_square_p(second, p1.tolist()) > 1e-3
    # and the test can fail: a sampler that ignores the residual is caught
    assert _chi_square_p(first, torch.softmax(logits[0], -1).roll(1).tolist()) < 1e-6


def test_greedy_verify_accepts_while_drafts_match():
    sampler = Sampler()
    logits = torch.full((4, 5), -5.0)
    for row, tok in enumerate([1, 2, 3, 4]):
        logits[row, tok] = 5.0
    req = Request("g", [0], SamplingParams(temperature=0.0))
    assert verify(sampler, logits, req, [1, 2, 3])[0] == [1, 2, 3, 4]  # all + bonus
    assert verify(sampler, logits, req, [1, 0, 3])[0] == [1, 2]  # recovered at the mismatch
    assert verify(sampler, logits[:1], req, [])[0] == [1]


def test_stats_mean_accepted_length():
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.accepted_per_pos == [1, 1, 0, 0] and stats.mean_accepted_length == 2.0


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tp2_matches_tp1_without_speculation(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    want = _tokens(_engine(path, False), GREEDY)
    tp2 = _engine(path, True, tensor_parallel_size=2)
    try:
        assert _tokens(tp2, GREEDY) == want
        assert _metric(tp2, "vllm:spec_decode_num_accepted_tokens") > 0
    finally:
        tp2.shutdown()
