"""The built-in default model: a small Llama-shaped config with seeded random weights.

No files are needed. Sized so one CPU step takes a few milliseconds and compilation wins are
visible: hidden 256, 4 layers, 8 heads (head_dim 32), 4 KV heads, intermediate 688, vocab 4096.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["DEFAULT_SEED", "default_hf_config", "default_moe_hf_config", "init_random_weights"]

DEFAULT_SEED = 0


def default_hf_config() -> dict[str, Any]:
    """A fresh HF-style ``config.json`` dict of the default model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def default_moe_hf_config() -> dict[str, Any]:
    """The built-in mixture-of-experts model: the default model's shape with a Mixtral MoE
    (8 experts, top-2) in place of each MLP. Used for data-parallel / expert-parallel demos."""
    config = default_hf_config()
    for key in ("mlp_bias", "attention_bias"):
        config.pop(key)
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=344,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    return config


def init_random_weights(model: nn.Module, seed: int = DEFAULT_SEED, std: float = 0.02) -> None:
    """Fill every parameter deterministically: norms with 1, biases with 0, the rest N(0, std).

    Values are drawn on the CPU in float32 so the same seed gives the same weights on every
    device and dtype.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values)
