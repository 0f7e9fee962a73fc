"""``LLM.chat`` as in vLLM: the conversation rendered by the tokenizer's chat template, the text
tokenized without special tokens added, then greedy generation; checked against
``transformers``' ``apply_chat_template`` + ``generate`` on a tiny model with a template."""

from __future__ import annotations

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "user",
         "assistant", "system", ":", "you", "are", "kind"]
TEMPLATE = ("<s>{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
CONVERSATION = [{"role": "system", "content": "you are kind"},
                {"role": "user", "content": "the cat sat on the mat"}]
OTHER = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                      {"type": "text", "text": "dog ran"}]}]
NEW = 6


def _checkpoint(path: str, template: str | None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, eos_token_id=2, bos_token_id=1,
                         initializer_range=0.3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory) -> str:
    return _checkpoint(str(tmp_path_factory.mktemp("chat")), TEMPLATE)


@pytest.fixture(scope="module")
def llm(chat_ckpt) -> LLM:
    return LLM(chat_ckpt, enforce_eager=True, max_model_len=96, dtype="float32")


def _transformers_reply(path: str, conversation: list[dict], template: str | None = None,
                        ) -> tuple[list[int], list[int]]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                   chat_template=template)
    ids = tok.encode(text, add_special_tokens=False)
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    return ids, out[0, len(ids):].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def test_chat_matches_transformers_template_and_generate(llm, chat_ckpt):
    ids, reply = _transformers_reply(chat_ckpt, CONVERSATION)
    assert 0 not in ids  # every piece of the rendered text is a real token
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert len(out) == 1
    assert out[0].prompt_token_ids == ids and ids[0] == 1 and ids.count(1) == 1  # BOS once
    assert out[0].outputs[0].token_ids == reply


def test_chat_takes_a_list_of_conversations_in_order(llm, chat_ckpt):
    flat = [{"role": "user", "content": "hello\ndog ran"}]
    outs = llm.chat([CONVERSATION, OTHER], GREEDY, use_tqdm=False)
    for out, conv in zip(outs, (CONVERSATION, flat)):
        ids, reply = _transformers_reply(chat_ckpt, conv)
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, reply)


def test_chat_without_generation_prompt(llm, chat_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_ckpt)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False)
    out = llm.chat(CONVERSATION, GREEDY, add_generation_prompt=False, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)


def test_no_template_is_a_clear_error_and_a_given_template_is_used(tmp_path):
    path = _checkpoint(str(tmp_path / "plain"), None)
    llm = LLM(path, enforce_eager=True, max_model_len=96, dtype="float32")
    with pytest.raises(ValueError, match="the tokenizer has no chat template; pass chat_template"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    ids, reply = _transformers_reply(path, CONVERSATION, template=TEMPLATE)
    out = llm.chat(CONVERSATION, GREEDY, chat_template=TEMPLATE, use_tqdm=False)[0]
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, reply)


@pytest.mark.parametrize(("messages", "match"), [
    ([], r"messages=\[\] is invalid"),
    ([{"content": "hi"}], r"messages\[0\]=.* expected a dict with a string 'role'"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content=5 is invalid"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"only text parts"),
])
def test_bad_messages_are_named(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_chat_without_tokenizer_is_refused():
    llm = LLM(enforce_eager=True, platform="cpu", max_model_len=32)
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
