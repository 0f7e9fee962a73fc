"""Huge ``top_k`` / ``seed`` are field-named ValueErrors when SamplingParams is built
(they used to pass and fail at the first step with torch's "Overflow when unpacking long long");
the largest accepted values still generate."""

from __future__ import annotations

import pytest

from forwardkit.engine.llm import LLM
from forwardkit.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**70}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),  # completion 1 would seed with 2**64
])
def test_out_of_range_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=\S+ is invalid; expected") as info:
        SamplingParams(**kwargs)
    assert "Overflow" not in str(info.value)


def test_deeply_nested_value_is_named_not_a_recursion_error():
    value: list = []
    for _ in range(1200):
        value = [value]
    with pytest.raises(ValueError, match=r"SamplingParams\.top_k=\[\[\["):
        SamplingParams(top_k=value)


@pytest.fixture(scope="module")
def llm():
    return LLM(enforce_eager=True, platform="cpu", max_model_len=32, max_num_seqs=2)


@pytest.mark.parametrize("kwargs", [
    {"top_k": 2**63 - 1},               # keeps every token
    {"seed": 2**64 - 2, "n": 2},        # seeds 2**64 - 2 and 2**64 - 1
    {"seed": -(2**63)},
])
def test_largest_accepted_values_generate(llm, kwargs):
    params = SamplingParams(max_tokens=2, **kwargs)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [2] * params.n
