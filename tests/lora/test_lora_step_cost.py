"""A step without adapters does no LoRA work (counted by ``lora_op_counts``, never timed):
eager, the op is not even called; in a compiled graph it is a node that returns at once, and
steps with and without adapters share the graph (nothing recompiles)."""

from __future__ import annotations

import dataclasses

import pytest

from forwardkit import LLM, LoRARequest, SamplingParams
from forwardkit.compilation.counters import compilation_counter
from forwardkit.layers.lora import lora_op_counts

PROMPTS = [[3, 4, 5, 6], [10, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PER_STEP = 2 * 4  # two layers x (qkv_proj, o_proj, gate_up_proj, down_proj)


def _counted(llm: LLM, lora: LoRARequest | None) -> tuple[int, int, int]:
    """(op calls, op runs that applied products, steps) of one greedy generate."""
    before = dataclasses.replace(lora_op_counts)
    steps = []
    real = llm.runner.execute

    def execute(batch, *args, **kwargs):
        steps.append(batch)
        return real(batch, *args, **kwargs)

    llm.runner.execute = execute  # type: ignore[method-assign]
    try:
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False,
                     lora_request=lora)
    finally:
        del llm.runner.execute
    return (lora_op_counts.calls - before.calls, lora_op_counts.applied - before.applied,
            len(steps))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "mode3"])
def test_a_step_without_adapters_skips_the_lora_op(lora_paths, compiled):
    base, adapter = lora_paths("llama_all")
    kwargs = dict(dtype="float32", max_model_len=64, max_num_seqs=4, enable_lora=True,
                  max_loras=2, max_lora_rank=8, enable_prefix_caching=False)
    if compiled:  # Dynamo's graph with the op as a node, no Inductor (quick to build)
        kwargs["compilation_config"] = {"mode": 3, "backend": "eager"}
    else:
        kwargs["enforce_eager"] = True
    llm = LLM(base, **kwargs)
    lora = LoRARequest("a", 1, adapter)
    calls, applied, steps = _counted(llm, lora)  # first: loads the adapter, any first compiles
    assert steps >= 4 and calls == applied == PER_STEP * steps
    started = compilation_counter.clone()
    calls, applied, steps = _counted(llm, None)
    assert steps >= 4 and applied == 0
    # eager: the op is not called at all; compiled: the graph's node runs and returns at once
    assert calls == (PER_STEP * steps if compiled else 0)
    calls, applied, steps = _counted(llm, lora)
    assert calls == applied == PER_STEP * steps
    delta = {k: v for k, v in compilation_counter.delta(started).items() if v}
    assert delta == {}, delta  # the same graph serves steps with and without adapters
