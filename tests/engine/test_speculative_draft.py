"""Draft-model speculative decoding: a second model proposes the drafts. Draft = target accepts
every draft; a different draft (same vocabulary, perturbed weights) leaves greedy tokens as
without speculation in eager and mode 3, under chunked prefill, forced preemption, stop
strings / tokens and ``max_tokens`` in the middle of an accepted run, ``n > 1``; random
sampling keeps the target's distribution with a draft ``q`` unlike ``p``; bad settings fail
at config time naming the field."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams
from forwardkit.engine.draft_model import DraftModelProposer
from forwardkit.engine.request import Request
from forwardkit.engine.sampler import Sampler
from forwardkit.engine.speculative import verify

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 8, 9, 5, 6, 7], [100, 101, 102], [7] * 5,
           list(range(30, 52))]
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
              enforce_eager=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def target(make_checkpoint) -> str:
    return make_checkpoint("llama_gqa_tied")


def _perturbed(source: str, out: str) -> str:
    """``source``'s checkpoint with every weight perturbed: the same vocabulary, drafts that
    are often but not always right."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(7)
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(source, name), out)
            continue
        tensors = load_file(os.path.join(source, name))
        noisy = {k: (v + 0.6 * v.std() * torch.randn(v.shape, generator=gen)).contiguous()
                 for k, v in tensors.items()}
        save_file(noisy, os.path.join(out, name), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory) -> str:
    return _perturbed(target, str(tmp_path_factory.mktemp("draft")))


def _spec(model: str, k: int = 4, **kw: object) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **kw}


def _engine(target: str, draft: str | None, **kw) -> LLM:
    extra = {} if draft is None else {"speculative_config": _spec(draft)}
    return LLM(target, **{**ENGINE, **kw}, **extra)


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


def test_draft_equal_to_target_accepts_every_draft(target):
    want = _tokens(_engine(target, None), GREEDY)
    spec = _engine(target, target)
    assert _tokens(spec, GREEDY) == want
    drafted = _metric(spec, "vllm:spec_decode_num_draft_tokens")
    assert drafted > 0 and _metric(spec, "vllm:spec_decode_num_accepted_tokens") == drafted
    # k = 4 drafts + 1 per verification, except near max_tokens where fewer are drafted
    assert _metric(spec, "forwardkit:spec_decode_mean_accepted_length") > 4.0


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 6, "max_num_seqs": 4},  # chunked prefill; the budget cuts drafts
    {"num_gpu_blocks": 16, "block_size": 4},  # forced preemption
], ids=["eager", "budget", "preemption"])
def test_greedy_tokens_identical_with_a_different_draft(target, draft, kw):
    want = _tokens(_engine(target, None, **kw), GREEDY)
    spec = _engine(target, draft, **kw)
    assert _tokens(spec, GREEDY) == want
    accepted = _metric(spec, "vllm:spec_decode_num_accepted_tokens")
    drafted = _metric(spec, "vllm:spec_decode_num_draft_tokens")
    assert 0 < accepted < drafted  # some drafts right, some wrong: both paths ran
    if "num_gpu_blocks" in kw:
        assert _metric(spec, "vllm:num_preemptions") > 0


def test_compiled_mode3(target, draft):
    want = _tokens(_engine(target, None), GREEDY)
    spec = _engine(target, draft, enforce_eager=False, compilation_config={"mode": 3})
    assert _tokens(spec, GREEDY) == want
    assert _metric(spec, "vllm:spec_decode_num_accepted_tokens") > 0


def test_limits_stops_and_n(target, draft):
    base, spec = _engine(target, None), _engine(target, draft)
    full = _tokens(base, GREEDY)
    for max_tokens in range(1, 12):  # every cut point, inside and between accepted runs
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert _tokens(spec, p) == [t[:max_tokens] for t in full], max_tokens
    stop = full[0][9]
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    assert _tokens(spec, p) == _tokens(base, p)
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=3, logprobs=2,
                       repetition_penalty=1.2)
    a = base.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
    b = spec.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.cumulative_logprob for c in x.outputs] == pytest.approx(
            [c.cumulative_logprob for c in y.outputs], abs=1e-3)
    short = dict(max_model_len=24)  # drafts never run past max_model_len
    assert _tokens(_engine(target, draft, **short), GREEDY) == _tokens(
        _engine(target, None, **short), GREEDY)


# ---------------------------------------------------------------------------- sleep, update_weights
def _kv_bytes(runner) -> int:
    return sum(t.untyped_storage().nbytes() for t in runner.kv_caches.values())


def test_sleep_and_wake_up_release_and_restore_the_draft_cache(target, draft):
    llm = _engine(target, draft)
    proposer = llm._proposer
    assert isinstance(proposer, DraftModelProposer)
    want = _tokens(llm, GREEDY)
    accepted = _metric(llm, "vllm:spec_decode_num_accepted_tokens")
    held, draft_held = _kv_bytes(llm.runner), _kv_bytes(proposer.runner)
    assert accepted > 0 and draft_held > 0
    assert llm.sleep() == held + draft_held
    assert _kv_bytes(proposer.runner) == 0 and not proposer._states
    assert llm.sleep() == 0  # already asleep, the draft too
    assert llm.wake_up(tags=["weights"]) == 0 and _kv_bytes(proposer.runner) == 0
    assert llm.wake_up() == held + draft_held
    assert _kv_bytes(proposer.runner) == draft_held
    assert not any(t.any() for t in proposer.runner.kv_caches.values())  # back zeroed
    assert _tokens(llm, GREEDY) == want
    assert _metric(llm, "vllm:spec_decode_num_accepted_tokens") == 2 * accepted
    with pytest.raises(ValueError, match=r"sleep\(level=2\) is not supported"):
        llm.sleep(level=2)
    assert _kv_bytes(proposer.runner) == draft_held  # a refused level changes nothing


def test_update_weights_acts_on_the_target_and_the_draft_keeps_its_own(target, draft):
    """``update_weights`` names the target's weights (vLLM's RL weight sync): the draft keeps
    its own weights, and its KV (a function of its weights and the tokens only) stays valid.
    Here the draft is the old target: after the update the tokens are those of a plain engine
    given the same update, and drafts are no longer all accepted (the draft kept its weights)."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(3)
    new = {}
    for name in os.listdir(target):
        if name.endswith(".safetensors"):
            for k, v in load_file(os.path.join(target, name)).items():
                new[k] = v + 0.25 * v.std() * torch.randn(v.shape, generator=gen)
    plain = _engine(target, None)
    plain.update_weights(new)
    want = _tokens(plain, GREEDY)
    assert want != _tokens(_engine(target, None), GREEDY)  # the update changes the tokens
    llm = _engine(target, target)
    _tokens(llm, GREEDY)  # the draft holds KV from the old target's run
    drafted = _metric(llm, "vllm:spec_decode_num_draft_tokens")
    assert _metric(llm, "vllm:spec_decode_num_accepted_tokens") == drafted > 0
    llm.update_weights(new)
    assert _tokens(llm, GREEDY) == want
    more = _metric(llm, "vllm:spec_decode_num_draft_tokens") - drafted
    accepted = _metric(llm, "vllm:spec_decode_num_accepted_tokens") - drafted
    assert 0 < accepted < more


def _char_checkpoint(path: str) -> str:
    """A tiny random Llama whose tokenizer has one token per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .!?"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, eos_token_id=2, bos_token_id=1,
                         initializer_range=0.5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def test_stop_strings_in_an_accepted_run(tmp_path):
    """Draft = target: every stop string falls inside an accepted run; text, tokens and
    stop reason are those of plain decoding."""
    path = _char_checkpoint(str(tmp_path))
    kw = dict(max_num_seqs=4, enforce_eager=True, max_model_len=96)
    base = LLM(path, **kw)
    spec = LLM(path, **kw, speculative_config=_spec(path, k=3))
    prompt = [[5, 6, 7, 8]]
    free = base.generate(prompt_token_ids=prompt, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stops = [free[i:i + 2] for i in (7, 11, 16) if free.find(free[i:i + 2]) == i]
    assert stops, free
    for stop in stops:
        for include in (False, True):
            p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                               include_stop_str_in_output=include)
            a = base.generate(prompt_token_ids=prompt, sampling_params=p, use_tqdm=False)
            b = spec.generate(prompt_token_ids=prompt, sampling_params=p, use_tqdm=False)
            x, y = a[0].outputs[0], b[0].outputs[0]
            assert (y.text, y.token_ids, y.stop_reason, y.finish_reason) == \
                (x.text, x.token_ids, x.stop_reason, x.finish_reason)
    assert _metric(spec, "vllm:spec_decode_num_accepted_tokens") == \
        _metric(spec, "vllm:spec_decode_num_draft_tokens") > 0


# ---------------------------------------------------------------------------- exact sampling
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=4),
], ids=["t1", "t0.8-topk"])
def test_rejection_sampling_with_draft_distributions(params):
    """Drafts drawn from a draft distribution ``q`` unlike the target's ``p``: with
    ``min(1, p/q)`` and the residual ``max(0, p - q)`` every emitted position follows ``p``
    (chi-square, fixed seeds and thresholds), and more drafts are accepted than when the same
    drafts are verified as point masses (also exact, accepted with ``p(x)`` only). A verifier
    told the wrong ``q`` (here: ``p`` itself, so it accepts everything) is caught."""
    from tests.engine.test_speculative import _chi_square_p

    torch.manual_seed(0)
    vocab, trials = 6, 12_000
    logits = torch.randn(3, vocab) * 1.5
    sampler = Sampler()
    req = Request("r", [0, 1], params, generator=torch.Generator().manual_seed(99))
    req.output_token_ids = [3]
    p = [sampler.target_distribution(logits[i:i + 1], req)[0] for i in range(3)]
    # the draft model's distributions: the target's logits shuffled, softened, mixed
    q = torch.softmax(logits.roll(1, dims=1) * 0.5 + torch.randn(3, vocab), dim=-1)[:2]
    draws = torch.Generator().manual_seed(5)
    ways = {"q": q, "point": None, "wrong": torch.stack(p[:2])}
    seen = {name: [[0] * vocab for _ in range(3)] for name in ways}
    accepted = dict.fromkeys(ways, 0)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=draws)) for i in range(2)]
        for name, dp in ways.items():
            emitted, _ = verify(sampler, logits, req, drafts, dp)
            assert req.output_token_ids == [3]
            accepted[name] += emitted[0] == drafts[0]
            for pos, tok in enumerate(emitted):
                seen[name][pos][tok] += 1
    for name in ("q", "point"):
        for pos in range(3):
            counts = seen[name][pos]
            assert sum(counts) > 300, (name, pos, counts)
            assert _chi_square_p(counts, p[pos].tolist()) > 1e-3, (name, pos, counts)
    assert accepted["q"] > 1.2 * accepted["point"]
    # acceptance of the first draft is sum(min(p, q)) with q, sum(p * q) as point masses
    assert accepted["q"] / trials == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.02)
    assert _chi_square_p(seen["wrong"][0], p[0].tolist()) < 1e-6


def test_random_sampling_end_to_end_is_seeded(target, draft):
    """Random sampling with a draft model runs (q from the draft, per request seeds), and the
    same seeds give the same tokens."""
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=11, n=2)
    a = _tokens(_engine(target, draft), p)
    b = _tokens(_engine(target, draft), p)
    assert a == b and all(len(t) == 16 for t in a)


# ---------------------------------------------------------------------------- bad settings
def test_bad_settings_fail_at_config_time(target, tmp_path):
    other = _char_checkpoint(str(tmp_path))  # 33 tokens, the target has 256
    cases = [
        (_spec(other), r"speculative_config.model='.*' has vocab_size=33, but the target "
                       r"model's is 256"),
        ({"method": "draft_model"}, "speculative_config.model is required"),
        (_spec(str(tmp_path / "missing")), "speculative_config.model='.*missing'.* not a "
                                           "directory"),
        (_spec(target, draft_tensor_parallel_size=3), "draft_tensor_parallel_size=3 is invalid; "
                                                       r"expected 1 or the target's .*\(1\)"),
        (_spec(target, draft_tensor_parallel_size=0), "draft_tensor_parallel_size=0 is invalid"),
        (_spec(target, k=0), "num_speculative_tokens must be >= 1"),
    ]
    for spec, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(target, speculative_config=spec, **ENGINE)


# ---------------------------------------------------------------------------- tp=2, dp=2
DP_PROMPTS = [[PROMPTS[0], PROMPTS[2], PROMPTS[4]], [PROMPTS[1]]]  # uneven: rank 1 idles early
DP_ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96,
                 enforce_eager=True)


def _dp_rank_main(rank: int, nprocs: int, port: int, path: str, spec: dict | None
                  ) -> tuple[list[list[int]], float]:
    from forwardkit.distributed import destroy_dp_group, init_dp_group

    init_dp_group(world_size=nprocs, rank=rank, master_port=port, backend="gloo", timeout_s=60)
    try:
        llm = LLM(path, data_parallel_size=nprocs, enable_expert_parallel=True, **DP_ENGINE,
                  **({} if spec is None else {"speculative_config": spec}))
        tokens = _tokens(llm, GREEDY, DP_PROMPTS[rank])
        return tokens, _metric(llm, "vllm:spec_decode_num_accepted_tokens")
    finally:
        destroy_dp_group()


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_dp2_greedy_identical_with_ngram_and_draft_model(make_checkpoint, tmp_path):
    """Data parallelism (which forwardkit runs for MoE models: Mixtral, experts split over the
    ranks): both ranks speculate on their own prompts, the draft runs on each rank alone."""
    from forwardkit.distributed.launch import spawn

    moe = make_checkpoint("mixtral")
    single = _engine(moe, None, **DP_ENGINE)
    ngram = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    for spec in (ngram, _spec(_perturbed(moe, str(tmp_path)), k=3)):
        results = spawn(_dp_rank_main, 2, args=(moe, spec), timeout_s=300)
        for rank, (tokens, accepted) in enumerate(results):
            assert tokens == _tokens(single, GREEDY, DP_PROMPTS[rank]), (spec, rank)
            assert accepted > 0


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tp2_target_with_a_one_rank_draft(target, draft):
    want = _tokens(_engine(target, None), GREEDY)
    tp2 = LLM(target, **ENGINE, tensor_parallel_size=2,
              speculative_config=_spec(draft, draft_tensor_parallel_size=1))
    try:
        assert _tokens(tp2, GREEDY) == want
        assert _metric(tp2, "vllm:spec_decode_num_accepted_tokens") > 0
    finally:
        tp2.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_tp2_draft_split_over_the_target_ranks(target, draft):
    """``draft_tensor_parallel_size`` equal to the target's: the draft is sharded over the
    LLM's own TP workers and runs its steps there; greedy tokens as without speculation and
    as with a one-rank draft; draft = target accepts every draft."""
    from forwardkit.engine.tp import weight_bytes

    want = _tokens(_engine(target, None), GREEDY)
    results = {}
    for dtp in (1, 2):
        llm = LLM(target, **ENGINE, tensor_parallel_size=2,
                  speculative_config=_spec(draft, draft_tensor_parallel_size=dtp))
        try:
            proposer = llm._proposer
            assert isinstance(proposer, DraftModelProposer)
            assert proposer.config.parallel_config.tensor_parallel_size == dtp
            results[dtp] = (_tokens(llm, GREEDY), weight_bytes(proposer.runner.module),
                            _metric(llm, "vllm:spec_decode_num_accepted_tokens"))
            if dtp == 2:  # the workers' draft shards sleep and wake with the target's
                held = 2 * (_kv_bytes(llm.runner) + _kv_bytes(proposer.runner))
                assert llm.sleep() == held and llm.wake_up() == held
                assert _tokens(llm, GREEDY) == results[2][0]
        finally:
            llm.shutdown()
    assert results[2][0] == want == results[1][0]
    assert results[2][2] > 0
    assert results[2][1] < 0.75 * results[1][1]  # the driver holds only its shard of the draft
    same = LLM(target, **ENGINE, tensor_parallel_size=2,
               speculative_config=_spec(target, draft_tensor_parallel_size=2))
    try:
        assert _tokens(same, GREEDY) == want
        drafted = _metric(same, "vllm:spec_decode_num_draft_tokens")
        assert drafted > 0 and _metric(same, "vllm:spec_decode_num_accepted_tokens") == drafted
    finally:
        same.shutdown()


def test_split_draft_needs_the_llm_own_tp_workers(target, draft):
    """Under torchrun (no worker pool) a draft over the TP ranks is refused by name."""
    from forwardkit.config.builder import build_engine_config

    cfg = build_engine_config(target, **ENGINE, tensor_parallel_size=2,
                              speculative_config=_spec(draft, draft_tensor_parallel_size=2))
    assert cfg.speculative_config is not None
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=2 needs the TP worker "
                                         r".*under torchrun the accepted value is 1"):
        DraftModelProposer(cfg.speculative_config, cfg, 16, 96, None)
