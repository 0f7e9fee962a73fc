"""RMSNorm as a :class:`CustomOp` (``rms_norm``), with the fused residual-add variant."""

from __future__ import annotations

import torch
import torch.nn as nn

from forwardkit.compilation.custom_op import CustomOp
from forwardkit.layers import kernels

__all__ = ["RMSNorm"]


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """``weight * x / rms(x)``; called with ``residual`` it first adds it and returns both.

    ``forward(x)`` -> normed; ``forward(x, residual)`` -> ``(normed(x + residual), x + residual)``.
    Normalisation runs in float32 and casts back before the weight is applied (as HF Llama does).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be positive, got {hidden_size}")
        self.hidden_size = hidden_size
        self.variance_epsilon = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pure-torch form."""
        if residual is None:
            return kernels.rms_norm_native(x, self.weight, self.variance_epsilon)
        residual = x + residual
        return kernels.rms_norm_native(residual, self.weight, self.variance_epsilon), residual

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Opaque-kernel form (``forwardkit::rms_norm`` / ``forwardkit::fused_add_rms_norm``)."""
        if residual is None:
            return torch.ops.forwardkit.rms_norm(x, self.weight, self.variance_epsilon)
        return torch.ops.forwardkit.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Same opaque kernels as on CUDA."""
        return self.forward_cuda(x, residual)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
