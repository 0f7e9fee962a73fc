"""A tiny float32 Llama checkpoint and its twins whose projection weights are replaced by their
dequantized values (the reference a quantized load must match)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_llama(**overrides: object):
    """Weights at std 0.2 so logits spread (greedy tokens are not decided by near-ties)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**TINY, **overrides}, rope_theta=10000.0,
                                   tie_word_embeddings=False, initializer_range=0.2,
                                   torch_dtype="float32")
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture
def tiny_llama():
    """The tiny Llama (transformers) with config overrides."""
    return _tiny_llama


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qllama")
    _tiny_llama().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def dequantized_dir(tmp_path_factory):
    """``fmt -> checkpoint dir`` of the tiny Llama with each projection weight replaced by
    dequantize(quantize(w)) (float32, exact)."""
    from forwardkit.quantization.formats import dequantize, quantize

    made: dict[str, str] = {}

    def make(fmt: str) -> str:
        if fmt not in made:
            model = _tiny_llama()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                        p.copy_(dequantize(quantize(p, fmt), fmt))
            path: Path = tmp_path_factory.mktemp(f"qllama_deq_{fmt}")
            model.save_pretrained(str(path))
            made[fmt] = str(path)
        return made[fmt]

    return make
