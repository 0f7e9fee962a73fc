"""Tiny Hugging Face checkpoints for the tensor-parallel tests, chosen so every TP code path
matters: query heads split, a single KV head replicated on both ranks, attention and MLP
biases (row-parallel bias added once), a vocabulary that does not divide by 2 (padding rows),
untied and tied heads, and Mixtral experts (split by intermediate slice, or by expert).
Weights use a 0.2 scale so attention is far from uniform and a wrong shard changes tokens."""

from __future__ import annotations

import torch

CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(
        vocab_size=251, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-6,
    )),
    "llama_tied": ("LlamaConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=256, rms_norm_eps=1e-6,
    )),
    "mixtral": ("MixtralConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    )),
}


def build(name: str, path: str) -> str:
    """Save checkpoint ``name`` (fp32 safetensors) under ``path``; returns ``path``."""
    import transformers

    cls_name, kwargs = CONFIGS[name]
    config = getattr(transformers, cls_name)(initializer_range=0.2, **kwargs)
    torch.manual_seed(4321)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):  # HF zero-initialises biases: make them matter
                p.normal_(0.0, 0.2)
    model.to(torch.float32).eval().save_pretrained(path, safe_serialization=True)
    return path
