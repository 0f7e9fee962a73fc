"""LoRA parity with transformers + peft: greedy tokens identical, logprobs close (fp32)."""

from __future__ import annotations

import pytest

from forwardkit import LLM, LoRARequest, SamplingParams

PROMPTS = [[3, 4, 5], [10 + i for i in range(19)], [7 * i % 256 for i in range(1, 30)]]
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _run(llm: LLM, lora: LoRARequest | None) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False,
                        lora_request=lora)
    res = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        res.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    return res


@pytest.mark.parametrize("name", ["llama_all", "llama_qv_down_rslora", "qwen2_subset",
                                  "qwen2_all_rslora", "mixtral_attn"])
def test_greedy_and_logprobs_match_peft(lora_paths, hf_reference, name):
    base, adapter = lora_paths(name)
    expected = hf_reference(adapter, base, PROMPTS, NEW)
    plain = hf_reference(None, base, PROMPTS, NEW)
    assert [t for t, _ in expected] != [t for t, _ in plain], "the adapter changes no token"
    # chunked prefill (budget 16) mixes prefill chunks and decodes in one step
    llm = LLM(base, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, enable_lora=True, max_lora_rank=16)
    got = _run(llm, LoRARequest(name, 1, adapter))
    for (tokens, lps), (want_tokens, want_lps) in zip(got, expected):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3
    # the same engine, no adapter: the base model's tokens
    assert [t for t, _ in _run(llm, None)] == [t for t, _ in plain]
