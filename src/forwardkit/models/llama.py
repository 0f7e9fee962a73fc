"""Llama family (``LlamaForCausalLM``; ``Qwen2ForCausalLM`` is Llama with q/k/v biases): GQA,
tied embeddings, explicit ``head_dim``, rope scaling, tensor parallelism.

``LlamaForCausalLM(engine_config)`` holds the decoder stack ``self.model = LlamaModel(...)``
(the unit ``support_torch_compile`` decorates) and the LM head. Layer names follow HF, so the
attention layer of block ``i`` is ``model.layers.i.self_attn.attn``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from forwardkit.compilation.decorators import support_torch_compile
from forwardkit.layers.activation import get_act_and_mul_fn
from forwardkit.layers.attention import Attention
from forwardkit.layers.layernorm import RMSNorm
from forwardkit.layers.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    current_tp,
    embedding_quant_methods,
)
from forwardkit.layers.rotary_embedding import get_rope, rope_parameters
from forwardkit.models.weights import load_named_weights

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["LlamaForCausalLM", "LlamaModel", "hf_config_of", "model_dtype_of"]


def hf_config_of(engine_config: EngineConfig) -> dict[str, Any]:
    """The HF config dict of the engine's model."""
    hf_config: dict[str, Any] = engine_config.require_model_config().hf_config
    return hf_config


def model_dtype_of(engine_config: EngineConfig) -> torch.dtype:
    """Parameter dtype: ``model_config.dtype``."""
    dtype: torch.dtype = engine_config.require_model_config().dtype
    return dtype


def _head_dim(cfg: dict[str, Any]) -> int:
    head_dim = cfg.get("head_dim")
    return int(head_dim) if head_dim else cfg["hidden_size"] // cfg["num_attention_heads"]


def attention_biases(cfg: dict[str, Any]) -> tuple[bool, bool]:
    """``(qkv bias, o_proj bias)``: Llama's ``attention_bias`` sets both; Qwen2 has biases on
    q/k/v only (its config has no ``attention_bias`` key)."""
    if cfg.get("model_type") == "qwen2":
        if cfg.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported (sliding-window "
                             "attention); accepted: use_sliding_window false or absent")
        return True, False
    bias = bool(cfg.get("attention_bias", False))
    return bias, bias


class LlamaAttention(nn.Module):
    """Self-attention block: merged QKV projection, rotary, paged attention, output projection.

    Under TP the block holds this rank's heads (``num_heads`` / ``num_kv_heads`` are local).
    """

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv_heads = cfg.get("num_key_value_heads") or total_heads
        self.head_dim = _head_dim(cfg)
        tp_rank, tp_size = current_tp()
        qkv_bias, o_bias = attention_biases(cfg)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads,
                                          bias=qkv_bias, dtype=dtype, tp_rank=tp_rank,
                                          tp_size=tp_size)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias,
                                        dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                                        what="num_attention_heads x head_dim")
        theta, scaling = rope_parameters(cfg)
        self.rotary_emb = get_rope(self.head_dim, cfg.get("max_position_embeddings", 2048), theta, scaling, dtype)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, prefix=f"{prefix}.attn"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Attention output for ``hidden_states`` [T, H] at ``positions`` [T]."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` with merged gate/up projection."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        tp_rank, tp_size = current_tp()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [(0, inter), (1, inter)], bias=bias, dtype=dtype, tp_rank=tp_rank,
            tp_size=tp_size, what="intermediate_size")
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, dtype=dtype, tp_rank=tp_rank,
                                           tp_size=tp_size, what="intermediate_size")
        self.act_fn = get_act_and_mul_fn(cfg.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MLP output."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block; the residual stream is carried separately (fused add + norm)."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype, prefix: str, mlp: nn.Module | None = None) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, dtype, prefix=f"{prefix}.self_attn")
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(block output, residual)``; their sum is the block's HF output."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile
class LlamaModel(nn.Module):
    """The decoder stack: ``forward(input_ids[T], positions[T]) -> hidden_states[T, H]``."""

    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, *, engine_config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = hf_config_of(engine_config)
        dtype = model_dtype_of(engine_config)
        self.config = cfg
        tp_rank, tp_size = current_tp()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], dtype,
                                                   tp_rank=tp_rank, tp_size=tp_size,
                                                   quant_method=embedding_quant_methods()[0])
        self.layers = nn.ModuleList(
            self.make_layer(cfg, dtype, f"{prefix}.layers.{i}" if prefix else f"layers.{i}")
            for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), dtype)

    def make_layer(self, cfg: dict[str, Any], dtype: torch.dtype, prefix: str) -> nn.Module:
        """One decoder block (subclasses swap the MLP)."""
        return LlamaDecoderLayer(cfg, dtype, prefix)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states of every token."""
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# HF checkpoint name -> (our parameter name, shard id) for merged projections.
# Which slice of a stacked parameter an HF tensor fills: "q" / "k" / "v" of qkv_proj, 0 / 1 of
# gate_up_proj, a Mixtral expert's (index, "w1" | "w2" | "w3") or a whole expert stack ("w13",
# "w2"); None for a plain parameter.
ShardId = str | int | tuple[int, str]

LLAMA_STACKED: tuple[tuple[str, str, ShardId], ...] = (
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
)


class LlamaForCausalLM(nn.Module):
    """Llama decoder plus LM head. ``forward`` returns hidden states; ``compute_logits`` the logits."""

    model_cls: type[LlamaModel] = LlamaModel
    stacked_params = LLAMA_STACKED

    def __init__(self, engine_config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = hf_config_of(engine_config)
        self.config = cfg
        self.model = self.model_cls(engine_config=engine_config, prefix=f"{prefix}.model" if prefix else "model")
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        tp_rank, tp_size = current_tp()
        self.lm_head = ParallelLMHead(
            cfg["vocab_size"], cfg["hidden_size"], model_dtype_of(engine_config),
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
            tp_rank=tp_rank, tp_size=tp_size, quant_method=embedding_quant_methods()[1],
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] of the decoder stack."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, V] for the given hidden states (gathered over TP: every rank
        gets all of them)."""
        return self.lm_head(hidden_states)

    def map_weight_name(self, name: str) -> tuple[str, ShardId | None] | None:
        """Our ``(parameter name, shard id)`` for HF tensor ``name``; None to skip it."""
        if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None  # tied: the embedding table is the head
        for hf_part, our_part, shard in self.stacked_params:
            if hf_part in name:
                return name.replace(hf_part, our_part), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the set of parameter names that were filled.

        Raises ``WeightLoadError`` naming unexpected and wrongly shaped tensors.
        """
        return load_named_weights(self, weights, self.map_weight_name)
