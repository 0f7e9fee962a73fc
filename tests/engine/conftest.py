"""Tiny random Hugging Face checkpoints (saved with ``save_pretrained``) and their greedy
reference continuations from ``transformers``; built once per session."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

VOCAB = 256

# name -> (config class name, config kwargs). Small enough to run in milliseconds per step.
CHECKPOINTS: dict[str, tuple[str, dict]] = {
    # GQA (4 query heads over 2 KV heads) and tied input/output embeddings.
    "llama_gqa_tied": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )),
    # Llama 3 rope scaling, original context 32 so the scaled frequencies matter; MQA.
    "llama3_rope": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, rope_parameters={
            "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
        },
    )),
    # Another llama3 variant: larger factor, narrower band, explicit head_dim != hidden/heads.
    "llama3_rope_wide": ("LlamaConfig", dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=24, rope_parameters={
            "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0,
            "high_freq_factor": 8.0, "original_max_position_embeddings": 16, "rope_theta": 500000.0,
        },
    )),
    "mixtral": ("MixtralConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=96,
    )),
}

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
)


def build_checkpoint(name: str, path: str) -> str:
    """Create and save the tiny model ``name`` (fp32, safetensors) under ``path``."""
    import transformers

    cls_name, extra = CHECKPOINTS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    torch.manual_seed(1234)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``make_checkpoint(name) -> dir``: the saved checkpoint ``name`` (built on first use)."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            cache[name] = build_checkpoint(name, str(tmp_path_factory.mktemp(name)))
        return cache[name]

    return make


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[str, list[list[int]], int], list[list[int]]]:
    """``hf_greedy(dir, prompts, n)``: transformers' greedy continuation of each prompt alone."""
    cache: dict[tuple, list[list[int]]] = {}

    def run(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        key = (path, tuple(map(tuple, prompts)), max_new_tokens)
        if key not in cache:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
            out = []
            with torch.no_grad():
                for ids in prompts:
                    seq = model.generate(
                        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=None,
                        pad_token_id=0,
                    )
                    out.append(seq[0, len(ids):].tolist())
            cache[key] = out
        return cache[key]

    return run
