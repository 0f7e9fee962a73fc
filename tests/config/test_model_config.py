"""ModelConfig: explicit construction and from_pretrained (reads a Hugging Face config.json)."""

from __future__ import annotations

import json

import pytest
import torch

from forwardkit.config.model import ModelConfig, resolve_dtype

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
    "vocab_size": 128,
    "torch_dtype": "bfloat16",
}


def _write(tmp_path, config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(tmp_path)


def test_from_pretrained_llama(tmp_path):
    m = ModelConfig.from_pretrained(_write(tmp_path, LLAMA))
    assert m.model == str(tmp_path)
    assert m.architectures == ["LlamaForCausalLM"] and m.architecture == "LlamaForCausalLM"
    assert not m.is_moe and not m.is_encoder_decoder and not m.is_pooling_model
    assert m.max_model_len == 4096
    assert m.dtype is torch.bfloat16
    assert m.get_hidden_size() == 64
    assert (m.get_num_layers(), m.get_num_attention_heads(), m.get_num_kv_heads()) == (2, 4, 2)
    assert (m.get_head_size(), m.get_vocab_size()) == (16, 128)
    assert m.hf_config == LLAMA


@pytest.mark.parametrize(
    "extra, is_moe",
    [({"num_local_experts": 8}, True), ({"num_experts": 4}, True), ({"num_local_experts": 0}, False),
     ({"num_experts": None}, False), ({}, False)],
)
def test_is_moe(extra, is_moe):
    assert ModelConfig(hf_config={**LLAMA, **extra}).is_moe is is_moe


@pytest.mark.parametrize(
    "dtype, hf_dtype, expected",
    [
        (None, "bfloat16", torch.bfloat16),
        ("auto", "float16", torch.float16),
        ("auto", None, torch.float32),
        ("float32", "bfloat16", torch.float32),
        ("bfloat16", None, torch.bfloat16),
        ("float16", None, torch.float16),
        ("torch.float16", None, torch.float16),
        (torch.bfloat16, "float32", torch.bfloat16),
    ],
)
def test_dtype(dtype, hf_dtype, expected):
    hf = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    if hf_dtype is not None:
        hf["torch_dtype"] = hf_dtype
    assert ModelConfig(hf_config=hf, dtype="auto" if dtype is None else dtype).dtype is expected
    assert resolve_dtype(dtype, hf) is expected


def test_dtype_key_variant_and_overrides(tmp_path):
    hf = {**{k: v for k, v in LLAMA.items() if k != "torch_dtype"}, "dtype": "float16"}
    m = ModelConfig.from_pretrained(_write(tmp_path, hf), max_model_len=1024, enforce_eager=True)
    assert m.dtype is torch.float16 and m.max_model_len == 1024 and m.enforce_eager
    assert ModelConfig.from_pretrained(str(tmp_path), dtype="float32").dtype is torch.float32


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="int8"), "unknown dtype 'int8'"),
        (dict(dtype=torch.int32), "unsupported dtype"),
        (dict(max_model_len=8192), r"max_model_len \(8192\) is larger than the model's max_position_embeddings \(4096\)"),
        (dict(max_model_len=0), "max_model_len must be >= 1"),
        (dict(runner="train"), "runner"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_invalid_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(hf_config=LLAMA, **kwargs)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        ModelConfig.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_pretrained(_write(tmp_path, "{not json"))
    with pytest.raises(ValueError, match="must hold a JSON object"):
        ModelConfig.from_pretrained(_write(tmp_path, "[1, 2]"))
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.from_pretrained(_write(tmp_path, LLAMA), bogus=1)


def test_explicit_defaults_and_pooling():
    m = ModelConfig()
    assert m.model is None and m.architectures == [] and m.max_model_len == 2048
    assert m.dtype is torch.float32
    with pytest.raises(ValueError, match="hidden_size"):
        m.get_hidden_size()
    pooling = ModelConfig(hf_config=LLAMA, runner="pooling")
    assert pooling.is_pooling_model and pooling.pooler_config == {}
    assert ModelConfig(hf_config={**LLAMA, "is_encoder_decoder": True}).is_encoder_decoder


def test_hash():
    base = ModelConfig(hf_config=LLAMA).compute_hash()
    assert ModelConfig(hf_config=dict(LLAMA)).compute_hash() == base
    assert ModelConfig(hf_config=LLAMA, dtype="float32").compute_hash() != base
    assert ModelConfig(hf_config=LLAMA, enforce_eager=True).compute_hash() != base
