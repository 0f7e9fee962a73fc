"""``LLM.generate`` input checks: ValueError naming the argument, the value and what is
accepted, and a rejected call changes no engine state (ids, seeded generator, queue)."""

from __future__ import annotations

import pytest

from forwardkit.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(make_checkpoint) -> LLM:
    return LLM(make_checkpoint("llama_gqa_tied"), max_num_seqs=4, enforce_eager=True,
               max_model_len=32, seed=21)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_token_ids=5), r"prompt_token_ids=5 is invalid; expected a list of integer token ids"),
    (dict(prompt_token_ids=1.5), r"prompt_token_ids=1\.5 is invalid; expected a list"),
    (dict(prompt_token_ids="12"), r"prompt_token_ids='12' is invalid"),
    (dict(prompt_token_ids=[[1, 2], 3]), r"prompt_token_ids\[1\]=3 is invalid"),
    (dict(prompt_token_ids=[1, 2.5]), r"token id 2\.5 is not an integer in \[0, 256\)"),
    (dict(prompt_token_ids=[True]), r"token id True is not an integer"),
    (dict(prompts=5), r"prompts=5 is invalid; expected a string, a list of strings"),
    (dict(prompts=1.5), r"prompts=1\.5 is invalid"),
    (dict(prompts=[{"prompt_token_ids": 7}]), r"prompt 0: prompt_token_ids=7 is invalid"),
    (dict(prompts=[{"text": "x"}]), r"prompt 0: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
    (dict(prompt_token_ids=[[1]], sampling_params={"temperature": 0}),
     r"sampling_params=\{'temperature': 0\} is invalid; expected a SamplingParams"),
])
def test_bad_inputs_raise_value_error(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(use_tqdm=False, **kwargs)


def test_rejected_call_consumes_no_state(make_checkpoint):
    """A call rejected for a too-long prompt (after valid ones) must not draw from the engine's
    seeded generator nor use request ids: the next call gives what a fresh engine gives."""
    path = make_checkpoint("llama_gqa_tied")
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)

    def engine() -> LLM:
        return LLM(path, max_num_seqs=4, enforce_eager=True, max_model_len=32, seed=21)

    fresh = engine().generate(prompt_token_ids=[[1, 2], [3]], sampling_params=sampled, use_tqdm=False)
    llm = engine()
    with pytest.raises(ValueError, match="max_model_len is 32"):
        llm.generate(prompt_token_ids=[[1, 2], [3] * 40], sampling_params=sampled, use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=[SamplingParams(stop_token_ids=5)])
    assert not llm.scheduler.has_unfinished
    after = llm.generate(prompt_token_ids=[[1, 2], [3]], sampling_params=sampled, use_tqdm=False)
    assert [o.request_id for o in after] == [o.request_id for o in fresh]
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in fresh]
