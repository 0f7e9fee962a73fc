"""``LLM.generate`` checks every ``SamplingParams`` it receives, so a field changed after
construction is refused (or, for ``stop``, normalised) exactly as the constructor would;
``n`` is bounded. Nothing is generated, and no request id is used, by a refused call."""

from __future__ import annotations

import math

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams
from forwardkit.engine.sampling_params import MAX_N

CHARS = "abcdefghijklmnopqrstuvwxyz .!?"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(enforce_eager=True, platform="cpu", max_model_len=32, max_num_seqs=2)


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0),
    ("n", 0),
    ("temperature", math.nan),
    ("top_p", 5),
    ("logprobs", -5),
    ("top_k", -7),
    ("min_p", 2.0),
    ("stop_token_ids", [-1]),
    ("ignore_eos", "yes"),
])
def test_field_changed_after_construction_is_refused(llm, field, value):
    params = SamplingParams(max_tokens=3)
    setattr(params, field, value)
    before = llm._next_id
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"sampling_params\[1\]: SamplingParams\.{field}="):
        llm.generate([{"prompt_token_ids": [1, 2]}] * 2, [SamplingParams(), params],
                     use_tqdm=False)
    assert llm._next_id == before  # nothing was queued


def test_n_is_bounded():
    with pytest.raises(ValueError, match=rf"SamplingParams\.n=1099511627776 is invalid; expected "
                                         rf"an integer in \[1, {MAX_N}\]"):
        SamplingParams(n=2**40)


def test_n_changed_after_construction_is_bounded(llm):
    params = SamplingParams(max_tokens=1)
    params.n = 2**40
    with pytest.raises(ValueError, match=r"SamplingParams\.n="):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)


@pytest.fixture(scope="module")
def char_llm(tmp_path_factory) -> LLM:
    """A tiny random Llama whose tokenizer has one token per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("char_ckpt"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
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
    return LLM(path, max_num_seqs=4, enforce_eager=True, max_model_len=96)


def test_stop_string_set_after_construction_acts(char_llm):
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = char_llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=free,
                             use_tqdm=False)[0].outputs[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2)
                if text.find(text[i:i + 2]) == i and len(set(text[i:i + 2])) == 2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    params.stop = stop  # a string, as the constructor accepts
    out = char_llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params,
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
