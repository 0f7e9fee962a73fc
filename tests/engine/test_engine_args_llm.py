"""The engine arguments that act on ``LLM`` itself, as in vLLM: ``tokenizer``,
``skip_tokenizer_init``, ``trust_remote_code`` (refused for code, accepted for configs),
``max_logprobs``, ``seed=None``; ``get_tokenizer()`` without a tokenizer raises."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from forwardkit.engine import LLM, SamplingParams

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def _save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory) -> str:
    """A tiny Llama without a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("bare"))
    config = LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok"))
    _save_tokenizer(path)
    return path


ENGINE = {"enforce_eager": True, "max_model_len": 32}


def test_tokenizer_from_another_directory(bare_checkpoint, tokenizer_dir):
    llm = LLM(bare_checkpoint, tokenizer=tokenizer_dir, **ENGINE)
    out = llm.generate(["the cat sat"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 7]
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids,
                                                             skip_special_tokens=True)


def test_tokenizer_directory_without_files_is_refused(bare_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer=.* is not a directory with tokenizer files"):
        LLM(bare_checkpoint, tokenizer=str(tmp_path), **ENGINE)


def test_get_tokenizer_without_one_raises(bare_checkpoint, tokenizer_dir):
    with pytest.raises(ValueError, match="has no tokenizer"):
        LLM(bare_checkpoint, **ENGINE).get_tokenizer()
    llm = LLM(bare_checkpoint, tokenizer=tokenizer_dir, skip_tokenizer_init=True, **ENGINE)
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.get_tokenizer()
    out = llm.generate(prompt_token_ids=[[5, 6]], use_tqdm=False)[0].outputs[0]
    assert out.token_ids and out.text == ""


def test_trust_remote_code_accepted_for_configs_refused_for_code(bare_checkpoint, tmp_path):
    llm = LLM(bare_checkpoint, trust_remote_code=True, **ENGINE)
    assert llm.generate(prompt_token_ids=[[5, 6]], use_tqdm=False)[0].outputs[0].token_ids
    coded = tmp_path / "coded"
    shutil.copytree(bare_checkpoint, coded)
    config = json.loads((coded / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
    (coded / "config.json").write_text(json.dumps(config))
    for trust in (True, False):
        with pytest.raises(ValueError, match=r"auto_map.*with or without trust_remote_code"):
            LLM(str(coded), trust_remote_code=trust, **ENGINE)


def test_max_logprobs_caps_requests_as_in_vllm():
    llm = LLM(platform="cpu", **ENGINE)
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs=21 asks for 21 logprobs, "
                                         r"more than max_logprobs=20"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(logprobs=21),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs=-1"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(prompt_logprobs=-1),
                     use_tqdm=False)
    uncapped = LLM(platform="cpu", max_logprobs=-1, **ENGINE)
    out = uncapped.generate(prompt_token_ids=[[1, 2]], use_tqdm=False,
                            sampling_params=SamplingParams(logprobs=21, max_tokens=1))[0]
    assert len(out.outputs[0].logprobs[0]) >= 21
    with pytest.raises(ValueError, match="max_logprobs must be"):
        LLM(platform="cpu", max_logprobs=-2, **ENGINE)


def test_seed_none_is_an_unseeded_engine():
    llm = LLM(platform="cpu", seed=None, **ENGINE)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]] * 4, sampling_params=params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
