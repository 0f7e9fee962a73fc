"""Named model shapes: Hugging Face ``config.json`` dicts of real architectures, no weights.

``model_shape_config("llama-3.2-1b")`` returns the config of a model with that architecture's
shape; the engine builds it with seeded random weights in memory (no download), so speed and
memory can be measured at the sizes people run. ``default`` is the small built-in model.
The figures are those each model's published ``config.json`` states.
"""

from __future__ import annotations

import copy
from typing import Any

from forwardkit.config.utils import short_repr

__all__ = ["BUILTIN_MODEL_SHAPE", "MODEL_SHAPES", "model_shape_config", "model_shape_names", "weight_bytes_per_token"]

_LLAMA3_ROPE_1B = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_LLAMA3_ROPE_8B = {**_LLAMA3_ROPE_1B, "factor": 8.0}

_DEFAULT: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 4096,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}

_DEFAULT_MOE: dict[str, Any] = {
    **{k: v for k, v in _DEFAULT.items() if k not in ("mlp_bias", "attention_bias")},
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "intermediate_size": 344,
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
    "output_router_logits": False,
}

_LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE_1B, "hidden_act": "silu", "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}

_LLAMA_3_1_8B: dict[str, Any] = {
    **_LLAMA_3_2_1B,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rope_scaling": _LLAMA3_ROPE_8B, "tie_word_embeddings": False,
}

_QWEN2_5_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151643,
}

# A small Mixtral-style mixture of experts (8 experts, top-2), about 0.5 B parameters.
_MIXTRAL_SMALL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
    "output_router_logits": False, "bos_token_id": 1, "eos_token_id": 2,
}

MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "default": _DEFAULT,
    "default-moe": _DEFAULT_MOE,
    "llama-3.2-1b": _LLAMA_3_2_1B,
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "qwen2.5-0.5b": _QWEN2_5_0_5B,
    "mixtral-small": _MIXTRAL_SMALL,
}
"""Shape name -> HF config dict (read-only: use :func:`model_shape_config` for a copy)."""

BUILTIN_MODEL_SHAPE = "default"
"""The shape of the built-in model: what an engine runs when given no checkpoint and no shape."""


def model_shape_names() -> list[str]:
    """The accepted shape names."""
    return list(MODEL_SHAPES)


def model_shape_config(name: str) -> dict[str, Any]:
    """A fresh copy of the HF config dict of shape ``name``."""
    if not isinstance(name, str) or name.strip().lower() not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {short_repr(name)}; accepted: {model_shape_names()}")
    return copy.deepcopy(MODEL_SHAPES[name.strip().lower()])


def weight_bytes_per_token(hf_config: dict[str, Any], itemsize: int, num_tokens: int = 1) -> int:
    """Weight bytes one decode step of ``num_tokens`` single-token requests reads.

    Every projection of every layer, the LM head (the embedding table when tied) and, for a
    mixture of experts, the experts the step is expected to touch: with ``E`` experts and
    top-``k`` routing a batch of ``n`` tokens reaches ``E * (1 - (1 - k/E)^n)`` of them.
    Embedding rows, norms and the KV cache are not counted.
    """
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    layers = int(hf_config["num_hidden_layers"])
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    experts = int(hf_config.get("num_local_experts") or 0)
    if experts:
        top_k = int(hf_config.get("num_experts_per_tok") or 2)
        touched = experts * (1.0 - (1.0 - top_k / experts) ** max(1, num_tokens))
        mlp = touched * 3 * hidden * inter + hidden * experts
    else:
        mlp = 3 * hidden * inter
    head = int(hf_config["vocab_size"]) * hidden
    return int((layers * (attn + mlp) + head) * itemsize)
