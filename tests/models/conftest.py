"""Tiny random HF checkpoints (saved with ``save_pretrained``) and a paged-KV driver for tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _save(model, path: Path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def _init_nonzero_biases(model) -> None:
    """HF initialises biases to 0; give them values so a mis-loaded bias shows."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    """GQA Llama with separate LM head, rope_theta 10000."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    _init_nonzero_biases(model)
    return _save(model, tmp_path_factory.mktemp("llama"))


def _llama_variant(init_scale: float = 0.02):
    """Tied embeddings, explicit head_dim (!= hidden/heads), biases, llama3 rope scaling."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        **{**TINY, "num_key_value_heads": 1},
        head_dim=24,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 50000.0,
        },
        rope_theta=50000.0,
        initializer_range=init_scale,
    )
    model = transformers.LlamaForCausalLM(cfg)
    _init_nonzero_biases(model)
    return model


def _qwen2(init_scale: float = 0.02):
    """Qwen2: biases on q/k/v only, tied embeddings."""
    torch.manual_seed(3)
    cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=True, rope_theta=1000000.0,
                                   initializer_range=init_scale)
    model = transformers.Qwen2ForCausalLM(cfg)
    _init_nonzero_biases(model)
    return model


# Weight scale of the bf16 parity checkpoints. With transformers' default 0.02 the attention
# scores are so small that attention is nearly uniform over the context and positions barely
# matter: a model with rotary switched off still met the bf16 tolerance. At 0.2 the logits
# reach ~6 and position matters (rotary off moves them by 3-8; tests/models/test_parity.py
# checks that this control exceeds the tolerance).
BF16_INIT_SCALE = 0.2


@pytest.fixture(scope="session")
def llama_variant_dir(tmp_path_factory) -> str:
    """Tied embeddings, explicit head_dim (!= hidden/heads), biases, llama3 rope scaling."""
    return _save(_llama_variant(), tmp_path_factory.mktemp("llama_variant"))


@pytest.fixture(scope="session")
def llama_variant_bf16_dir(tmp_path_factory) -> str:
    """``llama_variant_dir`` with weights at ``BF16_INIT_SCALE`` (for the bf16 parity tests)."""
    return _save(_llama_variant(BF16_INIT_SCALE), tmp_path_factory.mktemp("llama_variant_bf16"))


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory) -> str:
    """Mixtral with 4 experts, top-2."""
    torch.manual_seed(2)
    cfg = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg)
    _init_nonzero_biases(model)
    return _save(model, tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    """Qwen2: biases on q/k/v only, tied embeddings."""
    return _save(_qwen2(), tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def qwen2_bf16_dir(tmp_path_factory) -> str:
    """``qwen2_dir`` with weights at ``BF16_INIT_SCALE`` (for the bf16 parity tests)."""
    return _save(_qwen2(BF16_INIT_SCALE), tmp_path_factory.mktemp("qwen2_bf16"))


@dataclass
class PagedDriver:
    """Runs a forwardkit model step by step over a paged KV cache (like a tiny runner)."""

    model: torch.nn.Module
    engine_config: object
    block_size: int
    num_blocks: int = 64
    tables: dict[int, list[int]] = field(default_factory=dict)
    lens: dict[int, int] = field(default_factory=dict)
    next_block: int = 0

    def __post_init__(self) -> None:
        from forwardkit.kernels.cpu.router import attached_router
        from forwardkit.layers.kv_cache import bind_kv_cache

        # the model's CPU linear router (made by the loader), bound around each step as the
        # runner does; None for a model built without the loader
        self.router = attached_router(self.model)

        ctx = self.engine_config.compilation_config.static_forward_context
        dtype = next(self.model.parameters()).dtype  # the KV cache has the model's dtype
        bind_kv_cache(ctx, self.num_blocks, self.block_size, dtype, "cpu")
        # Hand out blocks in a scrambled order so tables are non-contiguous.
        self.free = list(reversed(range(self.num_blocks)))

    def _ensure_blocks(self, rid: int, seq_len: int) -> list[int]:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.block_size < seq_len:
            table.append(self.free.pop(0 if len(self.free) % 2 else -1))
        return table

    def step(self, chunks: dict[int, list[int]], pad_to: int | None = None) -> dict[int, torch.Tensor]:
        """Schedule ``chunks[rid]`` new tokens per request; returns each request's logits [q, V]."""
        from forwardkit.forward_context import set_forward_context
        from forwardkit.kernels.cpu.router import bind
        from forwardkit.layers.attention import build_attention_metadata

        ids, pos, q_lens, s_lens, tables = [], [], [], [], []
        for rid, toks in chunks.items():
            start = self.lens.get(rid, 0)
            end = start + len(toks)
            ids += toks
            pos += list(range(start, end))
            q_lens.append(len(toks))
            s_lens.append(end)
            tables.append(self._ensure_blocks(rid, end))
            self.lens[rid] = end
        n = len(ids)
        total = pad_to or n
        ids += [0] * (total - n)
        pos += [0] * (total - n)
        md = build_attention_metadata(q_lens, s_lens, tables, total, self.block_size, "cpu")
        ctx = self.engine_config.compilation_config.static_forward_context
        attn_md = {name: md for name in ctx}
        with torch.no_grad(), bind(self.router):
            with set_forward_context(attn_md, self.engine_config, num_tokens=total):
                hidden = self.model(torch.tensor(ids), torch.tensor(pos))
            logits = self.model.compute_logits(hidden[:n])
        out, offset = {}, 0
        for rid, q in zip(chunks, q_lens):
            out[rid] = logits[offset : offset + q]
            offset += q
        return out


def make_engine_config(model_dir: str | None, dtype: str = "float32", **kwargs):
    """An EngineConfig for ``model_dir``; eager (compilation mode NONE) unless told otherwise."""
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig

    kwargs.setdefault("compilation_config", {})
    kwargs["compilation_config"] = {"mode": 0, **kwargs["compilation_config"]}
    model_config = ModelConfig.from_pretrained(model_dir, dtype=dtype) if model_dir else None
    return EngineConfig(model_config=model_config, **kwargs)


@pytest.fixture
def load_fk():
    """``load_fk(model_dir, block_size=16) -> PagedDriver`` with the model loaded by forwardkit."""

    def load(model_dir: str, block_size: int = 16, **kwargs) -> PagedDriver:
        from forwardkit.models.loader import load_model

        config = make_engine_config(model_dir, **kwargs)
        model = load_model(config)
        return PagedDriver(model, config, block_size)

    return load
