"""Allocation of the paged KV cache and binding it to the registered attention layers."""

from __future__ import annotations

from typing import Any

import torch

from forwardkit.kernels.cpu import hugepages
from forwardkit.layers.attention import Attention
from forwardkit.layers.attention_backend import AttentionBackend

__all__ = ["attention_backend_of", "attention_layers", "bind_kv_cache", "kv_cache_bytes_per_block"]


def attention_layers(static_forward_context: dict[str, Any]) -> dict[str, Attention]:
    """The attention layers among the registered layers, in registration order."""
    return {name: layer for name, layer in static_forward_context.items() if isinstance(layer, Attention)}


def attention_backend_of(layers: dict[str, Attention]) -> type[AttentionBackend]:
    """The one attention backend the given layers share (the runner builds one metadata per
    step for all of them); a ``ValueError`` names the backends when they differ."""
    backends = {layer.backend for layer in layers.values()}
    if len(backends) != 1:
        names = sorted(b.name for b in backends)
        raise ValueError(
            f"the attention layers must share one attention backend, found {names or 'none'}"
        )
    return backends.pop()


def kv_cache_bytes_per_block(
    static_forward_context: dict[str, Any], block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block costs summed over all attention layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * block_size * layer.num_kv_heads * layer.head_size * itemsize
        for layer in attention_layers(static_forward_context).values()
    )


def bind_kv_cache(
    static_forward_context: dict[str, Any],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Allocate one zeroed cache per attention layer and set ``layer.kv_cache = [tensor]``.

    On a CPU the caches are zeroed lazily (:func:`forwardkit.kernels.cpu.hugepages.zero_`): their
    pages are committed as blocks are first written, not at start-up.

    Each cache has shape ``[2, num_blocks + 1, block_size, num_kv_heads, head_size]`` (the last
    block is scratch for padding rows, see ``attention_backend``); block ids ``0..num_blocks-1``
    are usable. Returns ``{layer_name: tensor}``.
    """
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(
            f"bind_kv_cache needs positive num_blocks and block_size, got {num_blocks}, {block_size}"
        )
    layers = attention_layers(static_forward_context)
    if not layers:
        raise ValueError("bind_kv_cache: no attention layers are registered in static_forward_context")
    caches: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        shape = layer.backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        cache = torch.empty(shape, dtype=dtype, device=device)
        caches[name] = hugepages.zero_(cache)  # on a CPU: zero pages mapped in on first touch
        layer.kv_cache = [caches[name]]
    return caches
