"""A toy model for the compilation tests: MLP blocks around a custom "attention" splitting op.

The op ``fktest::attn`` mutates its ``out`` argument (like forwardkit's
``unified_attention_with_output``), has a fake implementation and is called as
``torch.ops.fktest.attn(...)`` so the Dynamo graph holds an ``OpOverloadPacket``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from forwardkit.compilation.decorators import support_torch_compile

ATTN_OP = "fktest::attn"
CALLS: dict[str, int] = {"attn": 0}


@torch.library.custom_op(ATTN_OP, mutates_args=("out",))
def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    """Causal attention over all tokens (one sequence), written into ``out``."""
    CALLS["attn"] += 1
    o = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True
    )
    out.copy_(o.squeeze(0))


@attn.register_fake
def _(q, k, v, out, layer_name):
    return None


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    def __init__(self, hidden: int, name: str) -> None:
        super().__init__()
        self.name = name
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.Parameter(torch.ones(hidden))
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(rms_norm(x, self.norm1)).chunk(3, dim=-1)
        out = torch.empty_like(q)
        torch.ops.fktest.attn(q, k, v, out, self.name)
        x = x + self.o(out)
        return x + self.down(torch.nn.functional.silu(self.up(rms_norm(x, self.norm2))))


class ToyModel(nn.Module):
    """``num_layers`` blocks; ``forward(x[T, H]) -> [T, H]``."""

    def __init__(self, *, engine_config=None, prefix: str = "", hidden: int = 32, num_layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(hidden, f"{prefix}layers.{i}.attn") for i in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@support_torch_compile
class CompiledToyModel(ToyModel):
    """The decorated toy model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


PASS_SEEN: list[int] = []


def count_nodes_pass(graph: torch.fx.Graph) -> None:
    """A user post-grad pass for ``inductor_passes``: records the graph size, changes nothing."""
    PASS_SEEN.append(len(graph.nodes))
