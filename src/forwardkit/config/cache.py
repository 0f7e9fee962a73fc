"""``CacheConfig``: paged KV-cache layout (block size, number of blocks) and prefix caching."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.utils import hash_factors

__all__ = ["HASH_ALGOS", "CacheConfig", "HashAlgo", "check_hash_algo", "hash_algo_unavailable"]

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def hash_algo_unavailable(algo: str) -> str | None:
    """Why ``algo`` cannot be used on this machine (a missing package), or None."""
    if algo.startswith("xxhash"):
        try:
            import xxhash  # noqa: F401
        except ImportError:
            return (f"prefix_caching_hash_algo={algo!r} needs the xxhash package "
                    "(pip install xxhash); 'sha256' and 'sha256_cbor' need nothing")
    return None


def check_hash_algo(algo: object, field: str = "prefix_caching_hash_algo") -> None:
    """Raise ``ValueError`` naming ``field`` unless ``algo`` is a known, usable algorithm."""
    if algo not in HASH_ALGOS:
        raise ValueError(f"{field}={algo!r:.60} is invalid; expected one of "
                         f"{', '.join(repr(a) for a in HASH_ALGOS)}")
    reason = hash_algo_unavailable(str(algo))
    if reason is not None:
        raise ValueError(reason)


@dataclass(config=ConfigDict(extra="forbid"))
class CacheConfig(FreezableConfig):
    """Paged KV cache: tokens per block, (once profiled or given) the number of blocks, and
    automatic prefix caching."""

    block_size: int = 16
    """Tokens per KV-cache block; must be > 0."""
    num_gpu_blocks: int | None = None
    """Blocks to allocate per attention layer; None = decided when the cache is allocated."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks already computed for an identical prefix (on by default,
    as in vLLM). Changes which tokens a step computes, never the tokens generated."""
    prefix_caching_hash_algo: str = "sha256"
    """How full blocks are hashed: ``"sha256"`` (default), ``"sha256_cbor"``, ``"xxhash"`` or
    ``"xxhash_cbor"`` (the last two need the ``xxhash`` package)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be a positive number of tokens, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 0:
            raise ValueError(
                f"num_gpu_blocks must be None (decide later) or >= 0, got {self.num_gpu_blocks}"
            )
        check_hash_algo(self.prefix_caching_hash_algo)

    def compute_hash(self) -> str:
        """Hash of the fields that change the compiled graph (the block size; prefix caching
        changes only which tokens a step holds, never the graph)."""
        return hash_factors({"block_size": self.block_size})
