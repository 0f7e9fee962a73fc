"""Greedy generation with ``LLM.generate`` is token-identical to transformers (fp32)."""

from __future__ import annotations

import pytest

from forwardkit.engine import LLM, SamplingParams

# Different lengths so chunked prefill splits some prompts and mixes prefill with decode.
PROMPTS = [[3, 4, 5], [10 + i for i in range(19)], [7 * i % 256 for i in range(1, 38)], [42]]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def _untimed_linear_paths(monkeypatch):
    """The fixed linear paths: with timing on, which kernel a small weight uses (and so the
    rounding behind a near-tie argmax) would depend on this machine's speed."""
    from forwardkit.kernels.cpu.router import CpuLinearRouter

    monkeypatch.setattr(CpuLinearRouter, "timing_default", False)


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["llama_gqa_tied", "llama3_rope", "llama3_rope_wide", "mixtral"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked16", "whole-prompts"])
def test_greedy_matches_transformers(make_checkpoint, hf_greedy, name, chunked):
    path = make_checkpoint(name)
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    if chunked:
        llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                  enforce_eager=True, max_model_len=128)
    else:
        llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=128,
                  enable_chunked_prefill=False, enforce_eager=True, max_model_len=128)
    got = _generate(llm)
    assert got == expected
    # Every request finished and gave its KV blocks back.
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm.scheduler.has_unfinished


def test_greedy_matches_with_preemption(make_checkpoint, hf_greedy):
    """A KV cache too small for all requests at once preempts and recomputes, same tokens."""
    path = make_checkpoint("llama_gqa_tied")
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    # 6 blocks of 16 = 96 slots: the longest request needs 69, all four together 211.
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True,
              max_model_len=128, num_gpu_blocks=6)
    got = _generate(llm)
    assert got == expected
    assert llm.block_manager.num_free_blocks == 6


def test_one_request_or_many_same_tokens(make_checkpoint):
    """Continuous batching does not change a request's greedy tokens."""
    path = make_checkpoint("mixtral")
    llm = LLM(path, max_num_seqs=2, max_num_batched_tokens=16, enforce_eager=True, max_model_len=128)
    batched = _generate(llm)
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0]
             .outputs[0].token_ids for p in PROMPTS]
    assert alone == batched
