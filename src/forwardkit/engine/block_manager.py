"""``BlockManager``: fixed-size KV-cache blocks for requests, with automatic prefix caching.

Without prefix caching it is a free list: a request's ``block_ids`` grow as its tokens are
scheduled and all go back when it finishes or is preempted.

With prefix caching (``enable_prefix_caching``) each block also has a reference count and,
once full, a hash (``engine/block_hash.py``): the chain of its request's tokens up to its end,
plus the request's extra keys (``cache_salt``). One owner holds the three structures:

- ``hash -> block``: the blocks whose content is known, so a new request whose leading full
  blocks hash the same starts from them (:meth:`find_cached_prefix`, :meth:`admit`) instead of
  computing them again;
- reference counts: a block held by several requests is shared read-only; it is written only
  by the request that computes it, before anyone has read it;
- two free pools: blocks without a hash (taken first) and an LRU queue of freed blocks that
  keep their hash, evicted (hash dropped) only when no plain free block is left. A finished
  request's blocks are queued last block first, so a prefix's tail is evicted before its head.

A block's hash is registered when the block is allocated for the step that fills it (so the
siblings of an ``n > 1`` request admitted in the same step share it at once: the step writes
every layer's K/V before any attention reads it), and the block counts as *computed* once that
step has run (:meth:`mark_computed`). A registered block that is freed before its step ran
(an aborted step) loses its hash. Steps split into micro-batches may not read what the other
micro-batch writes, so ``find_cached_prefix(allow_pending=False)`` stops at the first block
that is not computed yet.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from forwardkit.engine.block_hash import BlockHash, BlockHasher
from forwardkit.engine.request import Request

__all__ = ["BlockManager", "PrefixCacheStats", "blocks_for"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, in tokens (vLLM's ``prefix_cache_queries`` / ``_hits``).

    ``queries`` / ``hits`` count first admissions: the tokens a new request asked for and the
    ones it found cached. A preempted request looking up its own blocks again is counted in
    ``preempted_queries`` / ``preempted_hits`` instead, so the hit rate measures sharing.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """KV blocks ``0 .. num_blocks-1`` of ``block_size`` tokens each (see the module doc).

    Args:
        num_blocks / block_size: the cache's layout.
        enable_prefix_caching: hash full blocks and share them between requests.
        hash_algo: ``CacheConfig.prefix_caching_hash_algo``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 hash_algo: str = "sha256") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid; expected at least 1 KV block")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid; expected a positive integer")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(hash_algo)
        self._free: deque[int] = deque(range(num_blocks))  # no hash: handed out first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # hashed, LRU first
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._computed = [False] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()

    # --------------------------------------------------------------------- capacity
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (plain free ones and cached ones that may be evicted)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is registered under a hash (held or free)."""
        return len(self._by_hash)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache can hold."""
        return self.num_blocks * self.block_size

    def num_blocks_to_grow(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks ``request`` needs to hold ``num_new_tokens`` more computed tokens."""
        needed = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether enough free blocks exist to schedule ``num_new_tokens`` for ``request``."""
        return self.num_blocks_to_grow(request, num_new_tokens) <= self.num_free_blocks

    # --------------------------------------------------------------------- prefix lookup
    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Make sure ``request.block_hashes`` covers every full block of its first
        ``num_tokens`` tokens."""
        hashes, size = request.block_hashes, self.block_size
        full = min(num_tokens, request.num_tokens) // size
        while len(hashes) < full:
            i = len(hashes)
            extra = request.block_extra_keys(i)
            hashes.append(self.hasher.hash_block(hashes[-1] if hashes else None,
                                                 request.token_slice(i * size, (i + 1) * size),
                                                 extra))

    def find_cached_prefix(self, request: Request, allow_pending: bool = True) -> list[int]:
        """The cached blocks ``request`` may start from: the longest run of its leading full
        blocks whose hashes are registered, capped so at least its last token is computed
        (its logits are needed). Empty when caching is off or the request skips reading.
        ``allow_pending=False`` stops at the first block not computed yet. Changes nothing."""
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, limit * self.block_size)
        hits: list[int] = []
        for h in request.block_hashes[:limit]:
            block = self._by_hash.get(h)
            if block is None or not (allow_pending or self._computed[block]):
                break
            hits.append(block)
        return hits

    def can_admit(self, request: Request, hits: Sequence[int], num_new_tokens: int) -> bool:
        """Whether ``request`` (holding no block) fits when it starts from the cached ``hits``
        and then runs ``num_new_tokens`` tokens."""
        total = blocks_for(len(hits) * self.block_size + num_new_tokens, self.block_size)
        reused_free = sum(1 for b in hits if self._ref[b] == 0)
        return total - len(hits) <= self.num_free_blocks - reused_free

    def admit(self, request: Request, hits: Sequence[int], num_new_tokens: int) -> None:
        """Start ``request`` (holding no block) from the cached ``hits``
        (``num_computed_tokens`` = their tokens), then allocate ``num_new_tokens`` more; records
        the lookup in :attr:`stats`. Callers check :meth:`can_admit` first."""
        if request.block_ids or request.num_computed_tokens:
            raise RuntimeError(f"request {request.request_id!r} already holds KV blocks")
        if not self.can_admit(request, hits, num_new_tokens):
            raise RuntimeError(f"KV cache exhausted: request {request.request_id!r} does not fit")
        for block in hits:
            self._take(block)
        request.block_ids = list(hits)
        hit_tokens = len(hits) * self.block_size
        request.num_computed_tokens = hit_tokens
        if self.enable_prefix_caching and not request.skip_reading_prefix_cache:
            stats = self.stats
            if request.num_preemptions:
                stats.preempted_requests += 1
                stats.preempted_queries += request.num_tokens
                stats.preempted_hits += hit_tokens
            else:
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit_tokens
        self.allocate(request, num_new_tokens)

    # --------------------------------------------------------------------- allocation
    def _take(self, block: int) -> None:
        """One more holder of ``block`` (out of the free pools if it was free)."""
        if self._ref[block] == 0:
            self._cached_free.pop(block, None)
        self._ref[block] += 1

    def _pop_free(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached_free.popitem(last=False)  # least recently used
            self._unregister(block)
        self._ref[block] = 1
        return block

    def _unregister(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            if self._by_hash.get(h) == block:
                del self._by_hash[h]
            self._hash[block] = None
        self._computed[block] = False

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow ``request.block_ids`` to cover ``num_new_tokens`` more tokens and register the
        blocks this step fills.

        Raises ``RuntimeError`` (and changes nothing) if the free pools are too short; callers
        check ``can_allocate`` first.
        """
        grow = self.num_blocks_to_grow(request, num_new_tokens)
        if grow > self.num_free_blocks:
            raise RuntimeError(
                f"KV cache exhausted: request {request.request_id!r} needs {grow} more blocks, "
                f"{self.num_free_blocks} free of {self.num_blocks}"
            )
        request.block_ids.extend(self._pop_free() for _ in range(grow))
        if self.enable_prefix_caching:
            self._register(request, request.num_computed_tokens + num_new_tokens)

    def _register(self, request: Request, num_tokens: int) -> None:
        """Register the hashes of ``request``'s full blocks within its first ``num_tokens``
        tokens (the step about to run computes them; :meth:`mark_computed` follows)."""
        self._extend_hashes(request, num_tokens)
        first = request.num_registered_blocks
        last = min(len(request.block_hashes), len(request.block_ids))
        for i in range(first, last):
            block, h = request.block_ids[i], request.block_hashes[i]
            if self._hash[block] is None and h not in self._by_hash:
                self._hash[block] = h
                self._by_hash[h] = block
                # already computed (its last tokens were accepted drafts of an earlier step)
                self._computed[block] = (i + 1) * self.block_size <= request.num_computed_tokens
        request.num_registered_blocks = max(first, last)

    def mark_computed(self, request: Request) -> None:
        """After a step: the blocks below ``request.num_computed_tokens`` hold their KV."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        for i in range(request.num_marked_blocks, full):
            block = request.block_ids[i]
            if self._hash[block] is not None:
                self._computed[block] = True
        request.num_marked_blocks = max(request.num_marked_blocks, full)

    def free(self, request: Request) -> None:
        """Drop ``request``'s hold on its blocks; a block nobody holds goes back to a free pool
        (with its hash, to the LRU queue, when its content was computed)."""
        for block in reversed(request.block_ids):  # tail first: evicted before the head
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if self._hash[block] is not None and self._computed[block]:
                self._cached_free[block] = None
            else:
                self._unregister(block)  # never computed (an aborted step): forget the hash
                self._free.append(block)
        request.block_ids = []
        request.num_registered_blocks = 0
        request.num_marked_blocks = 0

    def set_prefix_caching(self, enabled: bool) -> None:
        """Switch prefix caching on or off between requests (the cache starts empty either way;
        the benchmark compares both on one engine)."""
        if any(self._ref):
            raise RuntimeError("set_prefix_caching: requests hold KV blocks; switch between "
                               "generate calls")
        self.invalidate()
        self.enable_prefix_caching = enabled

    # --------------------------------------------------------------------- invalidation
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); False, changing nothing,
        while a request holds blocks."""
        if any(self._ref):
            return False
        self.invalidate()
        return True

    def invalidate(self) -> None:
        """Forget every hash now, held blocks included (their KV is stale, e.g. after a weight
        update); later lookups hit nothing that was computed before."""
        for block in range(self.num_blocks):
            self._hash[block] = None
            self._computed[block] = False
        self._by_hash.clear()
        self._free.extend(self._cached_free)
        self._cached_free.clear()

    # --------------------------------------------------------------------- checks
    def check_invariants(self, holders: Iterable[Request]) -> None:
        """Raise ``AssertionError`` if the pools, counts and hashes disagree with ``holders``
        (every request holding blocks): each block's count equals its holders, every block is
        either held or in exactly one free pool, the hash map and the blocks agree."""
        counts = [0] * self.num_blocks
        for req in holders:
            for block in req.block_ids:
                counts[block] += 1
        assert counts == self._ref, "reference counts differ from the requests holding blocks"
        free = list(self._free) + list(self._cached_free)
        assert len(free) == len(set(free)), "a block is free twice"
        used = [b for b in range(self.num_blocks) if self._ref[b] > 0]
        assert not set(free) & set(used), "a held block is in a free pool"
        assert len(free) + len(used) == self.num_blocks, "free + used != total"
        for block in self._cached_free:
            assert self._hash[block] is not None and self._computed[block], \
                "an LRU-queued block has no computed content"
        for block in self._free:
            assert self._hash[block] is None, "a plain free block keeps a hash"
        for h, block in self._by_hash.items():
            assert self._hash[block] == h, "hash map and block hash disagree"
        assert sum(h is not None for h in self._hash) == len(self._by_hash), \
            "a block carries a hash the map does not know"

    def block_hash(self, block: int) -> BlockHash | None:
        """The hash ``block`` is registered under (None: not cached)."""
        return self._hash[block]

    def is_computed(self, block: int) -> bool:
        """Whether ``block`` is registered and its step has run."""
        return self._computed[block]

    def ref_count(self, block: int) -> int:
        """How many requests hold ``block``."""
        return self._ref[block]
