"""``LLM`` compiles while it starts (like vLLM's profile run), not during the first generate."""

from __future__ import annotations

from forwardkit.compilation.counters import compilation_counter
from forwardkit.engine import LLM, SamplingParams


def test_compile_happens_at_start_up():
    before = compilation_counter.clone()
    llm = LLM(max_num_batched_tokens=64, max_num_seqs=8,
              compilation_config={"mode": 3, "backend": "eager"})
    started = compilation_counter.clone()
    assert started.num_dynamo_traces - before.num_dynamo_traces == 1
    assert started.num_backend_compilations > before.num_backend_compilations
    out = llm.generate(prompt_token_ids=[[1, 5, 9], [1, 7]],
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert compilation_counter.delta(started).get("num_dynamo_traces", 0) == 0
    assert compilation_counter.delta(started).get("num_backend_compilations", 0) == 0


def test_eager_model_skips_warm_up():
    llm = LLM(max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=True)
    assert llm.runner.warm_up_compile_ranges() == []


def test_cpu_warm_up_runs_a_small_step_per_range_and_covers_the_whole_range():
    llm = LLM(max_num_batched_tokens=64, max_num_seqs=8,
              compilation_config={"mode": 3, "backend": "eager"})
    assert llm.runner.warm_up_compile_ranges() == [2]  # range [1, 64]: 2 tokens, not 64
    started = compilation_counter.clone()
    out = llm.generate(prompt_token_ids=[list(range(1, 61))],  # a 60-token prefill step
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert compilation_counter.delta(started).get("num_backend_compilations", 0) == 0
