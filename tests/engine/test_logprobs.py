"""Sample and prompt logprobs against transformers' log-softmax on tiny checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams
from forwardkit.engine.logprobs import Logprob, logprob_dicts

TOL = 2e-4


def _hf_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits for every position of ``ids`` ([len, vocab])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def _check_position(d: dict[int, Logprob], ref: torch.Tensor, chosen: int, k: int) -> None:
    """``d`` holds ``chosen`` first (with its rank) and the top ``k`` (ranks 1..k) of ``ref``."""
    assert next(iter(d)) == chosen
    assert d[chosen].logprob == pytest.approx(ref[chosen].item(), abs=TOL)
    # rank = how many tokens are at least as likely (a band, for values within the tolerance)
    assert int((ref > ref[chosen] + TOL).sum()) + 1 <= d[chosen].rank <= int((ref >= ref[chosen] - TOL).sum())
    top = ref.topk(k)
    for r, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
        assert tid in d and d[tid].logprob == pytest.approx(value, abs=TOL)
        if tid != chosen:
            assert d[tid].rank == r + 1
    assert len(d) == k + (chosen not in top.indices.tolist())


@pytest.mark.parametrize("name", ["llama_gqa_tied", "mixtral"])
def test_sample_and_prompt_logprobs_match_transformers(make_checkpoint, name):
    path = make_checkpoint(name)
    # Budget 16 with a 37-token prompt: prompt logprobs come from three prefill chunks.
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              enforce_eager=True, max_model_len=128)
    prompts = [[7 * i % 256 for i in range(1, 38)], [3, 4, 5]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
              SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, logprobs=1)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for out, params_i in zip(outs, params):
        completion = out.outputs[0]
        ids = out.prompt_token_ids + completion.token_ids
        ref = _hf_logprobs(path, ids)
        P = len(out.prompt_token_ids)
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for j, (token, d) in enumerate(zip(completion.token_ids, completion.logprobs)):
            _check_position(d, ref[P - 1 + j], token, params_i.logprobs)
        expected_cum = sum(ref[P - 1 + j, t].item() for j, t in enumerate(completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected_cum, abs=1e-3)
        if params_i.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs) == P and out.prompt_logprobs[0] is None
            for p in range(1, P):
                _check_position(out.prompt_logprobs[p], ref[p - 1], ids[p], params_i.prompt_logprobs)


def test_logprobs_off_by_default_and_whole_vocab(make_checkpoint):
    llm = LLM(make_checkpoint("llama_gqa_tied"), max_num_seqs=2, enforce_eager=True, max_model_len=64,
              max_logprobs=-1)  # vLLM's cap (20) refuses the whole vocabulary otherwise
    plain = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None
    full = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=0), use_tqdm=False)[0]
    assert full.outputs[0].token_ids == plain.outputs[0].token_ids  # asking changes no token
    for d in full.outputs[0].logprobs:
        assert len(d) == 256
        assert math.fsum(math.exp(lp.logprob) for lp in d.values()) == pytest.approx(1.0, abs=1e-4)
        assert sorted(lp.rank for lp in d.values()) == list(range(1, 257))
    # prompt_logprobs=0: just the actual prompt token at each position
    assert [list(d) for d in full.prompt_logprobs[1:]] == [[2], [3]]


def test_prompt_logprobs_survive_preemption(make_checkpoint):
    """A preempted request recomputes its prompt; its prompt logprobs are not duplicated."""
    path = make_checkpoint("llama_gqa_tied")
    prompts = [[10 + i for i in range(19)], [7 * i % 256 for i in range(1, 38)], [42, 43]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    small = LLM(path, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True,
                max_model_len=128, num_gpu_blocks=6)
    roomy = LLM(path, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True, max_model_len=128)
    preempted = []
    original = small.scheduler._preempt
    small.scheduler._preempt = lambda req: (preempted.append(req.request_id), original(req))
    a = small.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert preempted  # the small cache did force recomputation
    b = roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for x, y in zip(a, b):
        assert len(x.prompt_logprobs) == len(x.prompt_token_ids)
        assert [list(d) for d in x.prompt_logprobs[1:]] == [list(d) for d in y.prompt_logprobs[1:]]


def test_logprob_dicts_unit():
    lp = torch.tensor([[0.1, 0.5, 0.2, 0.2]]).log()
    (d,) = logprob_dicts(lp, [0], [2])
    assert list(d) == [0, 1, 2] or list(d) == [0, 1, 3]
    assert d[0].rank == 4 and d[1].rank == 1
    (d,) = logprob_dicts(lp, [1], [1])
    assert list(d) == [1] and d[1].rank == 1
