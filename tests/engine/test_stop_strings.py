"""Stop strings (need a tokenizer) and ``include_stop_str_in_output``, vLLM 0.14.0 semantics:
the text is cut before the first stop string found, the token ids are kept, and
``stop_reason`` is the string."""

from __future__ import annotations

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams

CHARS = "abcdefghijklmnopqrstuvwxyz .!?"


@pytest.fixture(scope="module")
def char_llm(tmp_path_factory) -> LLM:
    """A tiny random Llama whose tokenizer has one token per character (text = joined chars)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("char_ckpt"))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, eos_token_id=2, bos_token_id=1,
                         initializer_range=0.5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return LLM(path, max_num_seqs=4, enforce_eager=True, max_model_len=96)


PROMPT = [5, 6, 7, 8]


def _free_run(llm: LLM) -> tuple[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids


def _stop_candidate(text: str) -> str:
    """A 2-character string first occurring well inside ``text``."""
    for start in range(6, len(text) - 2):
        s = text[start:start + 2]
        if text.find(s) == start:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def _reference_stop(llm: LLM, ids: list[int], stop: str, min_tokens: int = 0) -> tuple[int, int] | None:
    """(tokens generated, text index of the match) per the definition: after each token the
    newly decoded text (plus ``len(stop) - 1`` characters before it) is searched, once at
    least ``min_tokens`` tokens exist; text seen before that is not searched again."""
    checked = 0
    for n in range(1, len(ids) + 1):
        text = llm.get_tokenizer().decode(ids[:n], skip_special_tokens=True)
        start, checked = max(0, checked - len(stop) + 1), len(text)
        if n >= min_tokens and (at := text.find(stop, start)) != -1:
            return n, at
    return None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text(char_llm, include):
    text, ids = _free_run(char_llm)
    stop = _stop_candidate(text)
    n, at = _reference_stop(char_llm, ids, stop)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "never!"],
                            include_stop_str_in_output=include)
    out = char_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == ids[:n] and n < len(ids)  # generation ended on the completing token
    assert c.text == (text[: at + len(stop)] if include else text[:at])


def test_stop_string_respects_min_tokens(char_llm):
    text, ids = _free_run(char_llm)
    stop = text[1:3]  # matches within the first few tokens
    assert _reference_stop(char_llm, ids, stop)[0] < 10
    expected = _reference_stop(char_llm, ids, stop, min_tokens=10)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop, min_tokens=10)
    c = char_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0].outputs[0]
    if expected is None:
        assert c.finish_reason == "length" and c.text == text
    else:
        assert c.finish_reason == "stop" and c.token_ids == ids[: expected[0]]
        assert c.text == text[: expected[1]]
    assert len(c.token_ids) >= 10


def test_stop_string_over_length_limit_and_stop_token_text(char_llm):
    text, ids = _free_run(char_llm)
    stop = _stop_candidate(text)
    n, at = _reference_stop(char_llm, ids, stop)
    # max_tokens ends exactly on the completing token: the stop string still wins (vLLM).
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=stop)
    c = char_llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[:at]
    # A stop token's own text is left out unless include_stop_str_in_output.
    tok = next(t for t in ids[5:] if t >= 3)  # an ordinary (non-special) character
    first = ids.index(tok)
    decode = char_llm.get_tokenizer().decode
    for include in (False, True):
        c = char_llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[tok],
            include_stop_str_in_output=include))[0].outputs[0]
        assert c.stop_reason == tok and c.token_ids == ids[: first + 1]
        assert c.text == decode(ids[: first + 1 if include else first], skip_special_tokens=True)
    assert decode([tok]) in CHARS


def test_text_prompts_and_logprob_tokens_decoded(char_llm):
    out = char_llm.generate("abc", SamplingParams(temperature=0, max_tokens=3, logprobs=1,
                                                  prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt == "abc" and out.prompt_token_ids == [3, 4, 5]
    assert out.prompt_logprobs[1][4].decoded_token == "b"
    c = out.outputs[0]
    decoded = [c.logprobs[i][t].decoded_token for i, t in enumerate(c.token_ids) if t >= 3]
    assert "".join(decoded) == c.text


def test_stop_strings_need_a_tokenizer(make_checkpoint):
    llm = LLM(make_checkpoint("llama_gqa_tied"), max_num_seqs=2, enforce_eager=True, max_model_len=64)
    with pytest.raises(ValueError, match=r"SamplingParams.stop=\['x'\] needs the model's tokenizer"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(stop="x"), use_tqdm=False)
