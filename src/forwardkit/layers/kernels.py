"""Opaque ``torch.ops.forwardkit.*`` ops behind the enabled form of the norm, rotary and
activation CustomOps.

vLLM's enabled custom ops call hand-written kernels (``torch.ops._C.rms_norm`` ...), which
Inductor treats as opaque calls it cannot fuse. The ops in this module wrap the best stock
torch implementation instead (forwardkit's hand-written kernels are the CPU linear and paged
decode attention in :mod:`forwardkit.kernels.cpu`, not these); they keep vLLM's property, an
opaque node in the compiled graph, which is what the ``custom_ops`` setting is about. Each op
has a fake implementation so Dynamo and Inductor can trace through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["apply_rotary", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to the input dtype, then scaled (HF Llama order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@torch.library.custom_op("forwardkit::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Opaque RMSNorm: ``weight * normalise(x)``."""
    return rms_norm_native(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("forwardkit::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque ``residual = x + residual; return rms_norm(residual), residual``."""
    new_residual = x + residual
    return rms_norm_native(new_residual, weight, eps), new_residual


@fused_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return torch.empty_like(x), torch.empty_like(x)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@torch.library.custom_op("forwardkit::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Opaque SiLU-and-mul (the gated MLP activation)."""
    return silu_and_mul_native(x)


@silu_and_mul.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def apply_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style (HF Llama "rotate_half") rotary embedding of ``query``/``key`` [T, n*head_size].

    ``cos_sin_cache`` is [max_pos, head_size] holding cos in the first half, sin in the second.
    """
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, head_size)
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype).view(shape)

    return rotate(query), rotate(key)


@torch.library.custom_op("forwardkit::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque rotary embedding (see :func:`apply_rotary`)."""
    return apply_rotary(positions, query, key, cos_sin_cache, head_size)


@rotary_embedding.register_fake
def _(positions, query, key, cos_sin_cache, head_size):
    return torch.empty_like(query), torch.empty_like(key)
