"""Rotary embedding: config parsing (old and transformers-5 keys) and frequencies vs HF."""

from __future__ import annotations

import pytest
import torch

from forwardkit.layers.rotary_embedding import RotaryEmbedding, rope_parameters

LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_rope_parameters_old_and_new_keys():
    assert rope_parameters({}) == (10000.0, None)
    assert rope_parameters({"rope_theta": 5e5}) == (5e5, None)
    theta, scaling = rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}})
    assert theta == 5e5 and scaling["rope_type"] == "llama3"
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 123.0, **LLAMA3}}
    theta, scaling = rope_parameters(new)
    assert theta == 123.0 and scaling["factor"] == 8.0
    assert rope_parameters({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}) == (7.0, None)


@pytest.mark.parametrize("rope_type", ["default", "llama3", "linear"])
def test_cos_sin_match_transformers(engine_config, rope_type):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope_type, "rope_theta": 50000.0}
    if rope_type == "llama3":
        params.update(LLAMA3)
    elif rope_type == "linear":
        params["factor"] = 4.0
    cfg = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params
    )
    if rope_type == "default":
        hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
        inv_freq = hf_rotary.inv_freq
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    _, scaling = rope_parameters(cfg.to_dict())
    rope = RotaryEmbedding(32, 512, 50000.0, scaling)
    freqs = torch.outer(torch.arange(512).float(), inv_freq.float())
    torch.testing.assert_close(rope.cos_sin_cache[:, :16], freqs.cos(), atol=0, rtol=0)
    torch.testing.assert_close(rope.cos_sin_cache[:, 16:], freqs.sin(), atol=0, rtol=0)


def test_unsupported_rope_type(engine_config):
    with pytest.raises(ValueError, match="Unsupported rope_type 'yarn'; supported: \\['default', 'linear', 'llama3'\\]"):
        RotaryEmbedding(32, 64, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="missing key 'low_freq_factor'"):
        RotaryEmbedding(32, 64, 10000.0, {"rope_type": "llama3", "factor": 2.0})
