"""Activations as :class:`CustomOp` s: ``silu_and_mul`` (gated MLP) and the act-fn lookup."""

from __future__ import annotations

import torch

from forwardkit.compilation.custom_op import CustomOp
from forwardkit.layers import kernels

__all__ = ["SiluAndMul", "get_act_and_mul_fn"]


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d``."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """Pure-torch form."""
        return kernels.silu_and_mul_native(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """Opaque-kernel form (``forwardkit::silu_and_mul``)."""
        return torch.ops.forwardkit.silu_and_mul(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Same opaque kernel as on CUDA."""
        return torch.ops.forwardkit.silu_and_mul(x)


_ACT_AND_MUL = {"silu": SiluAndMul, "swish": SiluAndMul}


def get_act_and_mul_fn(name: str) -> CustomOp:
    """The gated activation for HF ``hidden_act`` ``name`` (only SiLU is supported)."""
    cls = _ACT_AND_MUL.get(name.lower())
    if cls is None:
        raise ValueError(f"Unsupported hidden_act {name!r}; supported: {sorted(_ACT_AND_MUL)}")
    return cls()
