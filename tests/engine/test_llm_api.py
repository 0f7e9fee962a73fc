"""LLM front end: argument handling, clear errors, seeds, stop tokens, block accounting."""

from __future__ import annotations

import pytest

from forwardkit.engine import LLM, SamplingParams
from forwardkit.engine.llm import LLM as LLMDirect


@pytest.fixture(scope="module")
def llm(make_checkpoint) -> LLM:
    # 8 blocks of 16 tokens = 128 slots; max_model_len 96.
    return LLM(make_checkpoint("llama_gqa_tied"), max_num_seqs=4, max_num_batched_tokens=32,
               enforce_eager=True, max_model_len=96, num_gpu_blocks=8, seed=7)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_lazy_export():
    assert LLM is LLMDirect


def test_too_long_prompt_names_the_request(llm):
    with pytest.raises(ValueError, match=r"request '\d+': prompt has 96 tokens but max_model_len is 96"):
        llm.generate(prompt_token_ids=[[1] * 10, [1] * 96], use_tqdm=False)
    # Nothing was queued by the failed call; the engine still works.
    assert not llm.scheduler.has_unfinished
    assert llm.generate(prompt_token_ids=[[1, 2]], use_tqdm=False)[0].outputs[0].token_ids


def test_request_larger_than_cache_is_rejected(make_checkpoint):
    small = LLM(make_checkpoint("llama_gqa_tied"), max_num_seqs=2, max_num_batched_tokens=16,
                enforce_eager=True, max_model_len=96, num_gpu_blocks=2)
    with pytest.raises(ValueError, match="whole cache holds 32"):
        small.generate(prompt_token_ids=[[1] * 20], sampling_params=SamplingParams(max_tokens=20),
                       use_tqdm=False)


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="prompt 0 is text but the model ships no tokenizer"):
        llm.generate("hello", use_tqdm=False)


@pytest.mark.parametrize("bad, match", [
    ([[1, 999]], r"token id 999 is not an integer in \[0, 256\)"),
    ([[1, -1]], "token id -1"),
    ([[]], "empty prompt"),
])
def test_bad_token_ids(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt_token_ids=bad, use_tqdm=False)


def test_prompt_forms_agree(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = _ids(llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=greedy, use_tqdm=False))
    b = _ids(llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False))
    assert a == b and len(a[0]) == 4
    with pytest.raises(ValueError, match="either prompts or prompt_token_ids"):
        llm.generate("x", prompt_token_ids=[1])
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=[greedy, greedy])
    assert llm.generate([], use_tqdm=False) == []
    with pytest.raises(ValueError, match="prompt 0 is int 5; expected text, a list of token ids"):
        llm.generate([5, 6], use_tqdm=False)


def test_seeded_sampling_is_reproducible(llm):
    prompts = [[1, 2, 3], [9, 8]]
    seeded = SamplingParams(temperature=1.0, top_k=20, max_tokens=8, seed=123, ignore_eos=True)
    first = _ids(llm.generate(prompt_token_ids=prompts, sampling_params=seeded, use_tqdm=False))
    second = _ids(llm.generate(prompt_token_ids=prompts[::-1], sampling_params=seeded,
                               use_tqdm=False))
    assert first == second[::-1]  # a request's seed fixes its tokens, whatever the batch
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = [_ids(llm.generate(prompt_token_ids=prompts, sampling_params=unseeded, use_tqdm=False))
            for _ in range(2)]
    assert runs[0] != runs[1]  # the engine seed advances between calls


def test_engine_seed_reproducible_across_instances(make_checkpoint):
    path = make_checkpoint("llama_gqa_tied")
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    outs = [_ids(LLM(path, enforce_eager=True, max_model_len=64, max_num_seqs=2, seed=s)
                 .generate(prompt_token_ids=[[1, 2], [3]], sampling_params=params, use_tqdm=False))
            for s in (5, 5, 6)]
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_stop_tokens_and_finish_reasons(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (free,) = _ids(llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=greedy, use_tqdm=False))
    stop_at = free[2]
    stop = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_at])
    out = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=stop, use_tqdm=False)[0]
    first = free.index(stop_at)
    assert out.outputs[0].token_ids == free[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    assert out.outputs[0].text == "" and out.prompt is None and out.finished


def test_max_tokens_none_runs_to_max_model_len(llm):
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[1] * 90], sampling_params=params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_blocks_returned_after_generate(llm):
    llm.generate(prompt_token_ids=[[1] * 30, [2] * 17, [3]], use_tqdm=False)
    assert llm.block_manager.num_free_blocks == 8


def test_unknown_keyword_is_a_type_error(make_checkpoint):
    with pytest.raises(TypeError, match="unknown engine argument 'not_a_field'"):
        LLM(make_checkpoint("llama_gqa_tied"), not_a_field=1)


def test_bad_model_dir(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "missing"))


def test_tqdm_progress(llm, capsys):
    llm.generate(prompt_token_ids=[[1, 2]], use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_greedy_matches_transformers(make_checkpoint, hf_greedy):
    """The default config compiles the model (piecewise, Inductor); tokens stay identical."""
    from forwardkit.config.compilation import CompilationMode

    path = make_checkpoint("llama_gqa_tied")
    prompts = [[3, 4, 5], [10 + i for i in range(19)]]
    expected = hf_greedy(path, prompts, 16)
    compiled = LLM(path, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    assert compiled.engine_config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    got = _ids(compiled.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False))
    assert got == expected
