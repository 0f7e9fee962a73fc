"""Rotary position embedding as a :class:`CustomOp` (``rotary_embedding``).

Supports the HF rope types ``default``, ``linear`` and ``llama3``; the inverse frequencies are
computed exactly as transformers computes them, so logits match to float32 rounding.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import torch

from forwardkit.compilation.custom_op import CustomOp
from forwardkit.config.model import SUPPORTED_ROPE_TYPES, rope_parameters
from forwardkit.layers import kernels

__all__ = ["RotaryEmbedding", "get_rope", "rope_parameters"]



def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    try:
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling {scaling!r} is missing key {e.args[0]!r}") from None
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@functools.lru_cache(maxsize=8)
def _cos_sin_cache(head_size: int, max_position: int, base: float, scaling_json: str | None,
                   device: str) -> torch.Tensor:
    """The ``[max_position, head_size]`` cos/sin table, computed once and shared by every layer
    with the same settings (a 128k-position table takes ~0.3 s to build)."""
    rope_scaling = json.loads(scaling_json) if scaling_json else None
    inv_freq = _default_inv_freq(base, head_size)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
    elif rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])  # type: ignore[index]
    elif rope_type != "default":
        raise ValueError(
            f"Unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    with torch.device(device):
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq.to(device).float())
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_size // 2
        return torch.cat((emb.cos()[:, :half], emb.sin()[:, :half]), dim=-1)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """NeoX-style rotary embedding with a precomputed ``[max_pos, head_size]`` cos/sin cache.

    ``forward(positions[T], query[T, Hq*D], key[T, Hk*D]) -> (query, key)`` rotated.
    """

    def __init__(
        self,
        head_size: int,
        max_position_embeddings: int,
        base: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"rotary head_size must be even, got {head_size}")
        self.head_size = head_size
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        cache = _cos_sin_cache(head_size, max_position_embeddings, base,
                               json.dumps(rope_scaling, sort_keys=True) if rope_scaling else None,
                               str(torch.get_default_device()))
        # NOTE: kept in float32 whatever the model dtype, like HF's autocast-free rotary.
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._dtype = dtype

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pure-torch form."""
        return kernels.apply_rotary(positions, query, key, self.cos_sin_cache, self.head_size)

    def forward_cuda(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Opaque-kernel form (``forwardkit::rotary_embedding``)."""
        return torch.ops.forwardkit.rotary_embedding(
            positions, query, key, self.cos_sin_cache, self.head_size
        )

    def forward_cpu(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same opaque kernel as on CUDA."""
        return self.forward_cuda(positions, query, key)


def get_rope(
    head_size: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> RotaryEmbedding:
    """Build the rotary embedding for a model's rope settings."""
    return RotaryEmbedding(head_size, max_position, base, rope_scaling, dtype)
