"""Mixtral family (``MixtralForCausalLM``): Llama attention with a sparse MoE MLP.

The MoE block (``block_sparse_moe``) has a replicated router (``gate``) and a
:class:`~forwardkit.layers.fused_moe.FusedMoE` holding this rank's experts. Checkpoints in both
the classic per-expert layout (``block_sparse_moe.experts.<e>.w1/w2/w3.weight``) and the
transformers-5 stacked layout (``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.gate``) load.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn

from forwardkit.compilation.decorators import support_torch_compile
from forwardkit.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from forwardkit.layers.fused_moe import FusedMoE
from forwardkit.layers.linear import Linear
from forwardkit.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, ShardId

__all__ = ["MixtralForCausalLM", "MixtralModel", "MixtralMoE"]

_EXPERT_RE = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


class MixtralMoE(nn.Module):
    """Router + experts: ``forward(x[T, H]) -> [T, H]``.

    Under TP each rank's experts give a share of the result (their intermediate slice, or with
    expert parallelism their experts); the block sums the shares over the TP group. With
    sequence-parallel MoE (EP, TP > 1, DP > 1) each TP rank routes only its slice of the rows
    (``sequence_parallel_chunk``) and the block gathers the slices over TP instead (vLLM has
    this path for other MoE families, not Mixtral).
    """

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        num_experts = cfg["num_local_experts"]
        self.gate = Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.experts = FusedMoE(
            num_experts, cfg["num_experts_per_tok"], hidden, cfg["intermediate_size"],
            renormalize=True, dtype=dtype, prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Routed expert mixture of every row."""
        experts = self.experts
        if experts.is_sequence_parallel:
            # each TP rank routes its slice of the rows; the slices are gathered back
            num_tokens = hidden_states.shape[0]
            local = torch.ops.forwardkit.sequence_parallel_chunk(
                hidden_states, experts.tp_size, experts.tp_rank)
            out = experts(local, self.gate(local))
            gathered = tensor_model_parallel_all_gather(out, experts.tp_size, dim=0)
            return gathered[:num_tokens]
        out = experts(hidden_states, self.gate(hidden_states))
        return tensor_model_parallel_all_reduce(out, experts.tp_size)


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama block whose MLP is the sparse MoE block (attribute ``block_sparse_moe``)."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype, prefix: str) -> None:
        super().__init__(cfg, dtype, prefix, mlp=MixtralMoE(cfg, dtype, f"{prefix}.block_sparse_moe"))

    @property
    def block_sparse_moe(self) -> nn.Module:
        """HF's name for the MoE block."""
        return self.mlp


@support_torch_compile
class MixtralModel(LlamaModel):
    """The Mixtral decoder stack: ``forward(input_ids[T], positions[T]) -> hidden_states[T, H]``."""

    def make_layer(self, cfg: dict[str, Any], dtype: torch.dtype, prefix: str) -> nn.Module:
        """A Mixtral block."""
        return MixtralDecoderLayer(cfg, dtype, prefix)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral decoder plus LM head (same interface as :class:`LlamaForCausalLM`)."""

    model_cls = MixtralModel

    def map_weight_name(self, name: str) -> tuple[str, ShardId | None] | None:
        """Map HF names, including both expert layouts, to ``(parameter, shard id)``."""
        name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(
            ".mlp.experts.", ".block_sparse_moe.experts."
        )
        match = _EXPERT_RE.search(name)
        if match:
            expert, which = int(match.group(1)), match.group(2)
            param = "w2_weight" if which == "w2" else "w13_weight"
            return name[: match.start()] + f".mlp.experts.{param}", (expert, which)
        if name.endswith(".block_sparse_moe.experts.gate_up_proj"):
            return name.replace(".block_sparse_moe.experts.gate_up_proj", ".mlp.experts.w13_weight"), "w13"
        if name.endswith(".block_sparse_moe.experts.down_proj"):
            return name.replace(".block_sparse_moe.experts.down_proj", ".mlp.experts.w2_weight"), "w2"
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        return super().map_weight_name(name)
