"""``CacheConfig``: paged KV-cache layout (block size, number of blocks)."""

from __future__ import annotations

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.utils import hash_factors

__all__ = ["CacheConfig"]


@dataclass(config=ConfigDict(extra="forbid"))
class CacheConfig(FreezableConfig):
    """Paged KV cache: tokens per block and (once profiled or given) the number of blocks."""

    block_size: int = 16
    """Tokens per KV-cache block; must be > 0."""
    num_gpu_blocks: int | None = None
    """Blocks to allocate per attention layer; None = decided when the cache is allocated."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be a positive number of tokens, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 0:
            raise ValueError(
                f"num_gpu_blocks must be None (decide later) or >= 0, got {self.num_gpu_blocks}"
            )

    def compute_hash(self) -> str:
        """Hash of the fields that change the compiled graph (the block size)."""
        return hash_factors({"block_size": self.block_size})
