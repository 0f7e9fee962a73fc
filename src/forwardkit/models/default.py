"""The built-in default model: a small Llama-shaped config with seeded random weights.

No files are needed. Sized so one CPU step takes a few milliseconds and compilation wins are
visible: hidden 256, 4 layers, 8 heads (head_dim 32), 4 KV heads, intermediate 688, vocab 4096.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from forwardkit.config.model_shapes import model_shape_config
from forwardkit.layers.parallel import copy_full, full_shape

__all__ = ["DEFAULT_SEED", "default_hf_config", "default_moe_hf_config", "init_random_weights"]

DEFAULT_SEED = 0


def default_hf_config() -> dict[str, Any]:
    """A fresh HF-style ``config.json`` dict of the default model (the ``default`` shape)."""
    return model_shape_config("default")


def default_moe_hf_config() -> dict[str, Any]:
    """The built-in mixture-of-experts model: the default model's shape with a Mixtral MoE
    (8 experts, top-2) in place of each MLP. Used for data-parallel / expert-parallel demos."""
    return model_shape_config("default-moe")


# Tensors above this many elements are filled from a seeded pool (drawing a billion normal
# values one by one takes ~10 s on 2 cores; the pool makes a 1B-parameter shape start in ~1 s).
_POOL_THRESHOLD = 1 << 22
_POOL_CHUNK = 1 << 20


def init_random_weights(model: nn.Module, seed: int = DEFAULT_SEED, std: float = 0.02) -> None:
    """Fill every parameter deterministically: norms with 1, biases with 0, the rest N(0, std).

    Values are drawn on the CPU in float32 so the same seed gives the same weights on every
    device and dtype. A tensor of more than 4M elements is filled in 1M-value chunks, each
    copied from a random offset of one seeded pool of 4M normal values: still N(0, std)
    element-wise and deterministic, fast enough for billion-parameter shapes. A parameter
    that is one rank's shard of a tensor-parallel (or expert-parallel) weight gets its part of
    the values the whole tensor would get, so every TP size builds the same model.
    """
    generator = torch.Generator().manual_seed(seed)
    pool: torch.Tensor | None = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = full_shape(param)
            numel = math.prod(shape)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif numel <= _POOL_THRESHOLD:
                values = torch.randn(shape, generator=generator, dtype=torch.float32) * std
                copy_full(param, values)
            else:
                if pool is None or pool.dtype != param.dtype or pool.device != param.device:
                    if pool is None:
                        pool32 = torch.randn(_POOL_THRESHOLD + _POOL_CHUNK, generator=generator) * std
                    # chunk copies are then plain memcpy on the parameter's device
                    pool = pool32.to(device=param.device, dtype=param.dtype)
                whole = param if tuple(shape) == tuple(param.shape) else param.new_empty(shape)
                flat = whole.view(-1)
                offsets = torch.randint(0, _POOL_THRESHOLD, (-(-numel // _POOL_CHUNK),),
                                        generator=generator)
                _fill_from_pool(flat, pool, offsets)
                if whole is not param:
                    copy_full(param, whole)


def _fill_from_pool(flat: torch.Tensor, pool: torch.Tensor, offsets: torch.Tensor) -> None:
    """``flat[i*C:(i+1)*C] = pool[offsets[i]:offsets[i]+C]`` for every chunk ``i`` (``C`` =
    ``_POOL_CHUNK``; the last chunk may be shorter). The whole chunks are one ``index_select``
    over overlapping windows of the pool: one call that releases the GIL once, instead of one
    Python-level copy per chunk (a 1B shape has ~1200), so threads running beside the loader
    (the compiler-import prefetch) do not stall it at every chunk."""
    whole = flat.numel() // _POOL_CHUNK
    if whole:
        windows = pool.as_strided((_POOL_THRESHOLD, _POOL_CHUNK), (1, 1))
        torch.index_select(windows, 0, offsets[:whole].to(pool.device),
                           out=flat[:whole * _POOL_CHUNK].view(whole, _POOL_CHUNK))
    tail = flat.numel() - whole * _POOL_CHUNK
    if tail:
        start = int(offsets[whole])
        flat[whole * _POOL_CHUNK:].copy_(pool[start:start + tail])
