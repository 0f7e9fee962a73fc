"""Presence / frequency / repetition penalties (against a reference written from their
definitions, on transformers' logits) and ``n`` completions with vLLM's seed semantics."""

from __future__ import annotations

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams
from forwardkit.engine.request import Request
from forwardkit.engine.sampler import Sampler


def reference_penalties(logits: list[float], prompt: list[int], output: list[int],
                        presence: float, frequency: float, repetition: float) -> list[float]:
    """The definitions, token by token: repetition on prompt + output tokens (divide positive,
    multiply negative logits), then frequency per output occurrence, then presence once."""
    out = list(logits)
    for t in range(len(out)):
        count = output.count(t)
        if t in prompt or count:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        out[t] -= frequency * count
        if count:
            out[t] -= presence
    return out


@pytest.mark.parametrize("presence, frequency, repetition", [
    (0.0, 0.0, 1.7), (1.5, 0.0, 1.0), (0.0, 0.9, 1.0), (0.4, 0.3, 1.3), (-0.5, -0.5, 0.7),
])
def test_sampler_penalties_match_reference(presence, frequency, repetition):
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(2, vocab) * 3
    prompt, output = [1, 2, 2, 9], [3, 3, 3, 1, 5]
    params = SamplingParams(temperature=0, presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition, max_tokens=50)
    penalised = Request("a", prompt, params)
    penalised.output_token_ids = list(output)
    plain = Request("b", prompt, SamplingParams(temperature=0))
    plain.output_token_ids = list(output)
    from forwardkit.engine.penalties import apply_penalties

    got = apply_penalties(logits.clone(), [penalised, plain])
    expected = reference_penalties(logits[0].tolist(), prompt, output, presence, frequency, repetition)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.equal(got[1], logits[1])  # the request without penalties is untouched


@pytest.mark.parametrize("knobs", [
    dict(repetition_penalty=1.8), dict(presence_penalty=1.2, frequency_penalty=0.8),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
])
def test_penalised_greedy_matches_reference_on_transformers(make_checkpoint, knobs):
    """Greedy decoding with penalties equals argmax of the reference penalties applied to
    transformers' logits, step by step."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint("llama_gqa_tied")
    prompts = [[5, 5, 6, 7], [10 + i % 3 for i in range(17)]]
    steps = 12
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              enforce_eager=True, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, **knobs)
    got = [o.outputs[0].token_ids for o in
           llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    plain = [o.outputs[0].token_ids for o in llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=steps,
                                                                 ignore_eos=True), use_tqdm=False)]
    assert got != plain  # the penalties changed something
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got):
        output: list[int] = []
        with torch.no_grad():
            for _ in range(steps):
                logits = model(torch.tensor([prompt + output])).logits[0, -1].float().tolist()
                scores = reference_penalties(logits, prompt, output, knobs.get("presence_penalty", 0.0),
                                             knobs.get("frequency_penalty", 0.0),
                                             knobs.get("repetition_penalty", 1.0))
                output.append(max(range(len(scores)), key=scores.__getitem__))
        assert tokens == output


def test_penalties_cost_nothing_when_off(monkeypatch):
    import forwardkit.engine.sampler as sampler_module

    calls = []
    monkeypatch.setattr(sampler_module, "apply_penalties", lambda *a: calls.append(a))
    req = Request("a", [1], SamplingParams(temperature=0))
    Sampler()(torch.randn(1, 5), [req])
    assert calls == []


@pytest.fixture(scope="module")
def llm(make_checkpoint) -> LLM:
    return LLM(make_checkpoint("llama_gqa_tied"), max_num_seqs=8, max_num_batched_tokens=32,
               enforce_eager=True, max_model_len=64, seed=3)


def test_n_with_seed_is_seed_plus_index(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=100, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    singles = [llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False, sampling_params=SamplingParams(
        temperature=1.0, seed=100 + i, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
        for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) == 3


def test_n_without_seed_reproducible_per_engine_seed(make_checkpoint):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = []
    for _ in range(2):
        llm = LLM(make_checkpoint("llama_gqa_tied"), max_num_seqs=4, enforce_eager=True,
                  max_model_len=64, seed=9)
        outs = llm.generate(prompt_token_ids=[[4, 5], [6]], sampling_params=params, use_tqdm=False)
        assert [len(o.outputs) for o in outs] == [2, 2]
        assert all(len(c.logprobs) == 6 and c.cumulative_logprob is not None
                   for o in outs for c in o.outputs)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
    assert runs[0] == runs[1]
    assert runs[0][0][0] != runs[0][0][1]  # the two completions sample independently


def test_n_greedy_completions_are_equal_and_blocks_return(llm):
    params = SamplingParams(n=4, temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    (out,) = llm.generate(prompt_token_ids=[[9, 8, 7]], sampling_params=params, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1 and len(out.outputs) == 4
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 3
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
