"""``BlockManager``: hands out fixed-size KV-cache blocks to requests and takes them back."""

from __future__ import annotations

from collections import deque

from forwardkit.engine.request import Request

__all__ = ["BlockManager", "blocks_for"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """A free list of block ids ``0 .. num_blocks-1`` of ``block_size`` tokens each.

    A request owns ``request.block_ids`` (its block table, in position order); blocks are
    added lazily as its tokens are scheduled and all returned by ``free``. No prefix sharing.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid; expected at least 1 KV block")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid; expected a positive integer")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any request."""
        return len(self._free)

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
        return self.num_blocks_to_grow(request, num_new_tokens) <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow ``request.block_ids`` to cover ``num_new_tokens`` more tokens.

        Raises ``RuntimeError`` (and changes nothing) if the free list is too short; callers
        check ``can_allocate`` first.
        """
        grow = self.num_blocks_to_grow(request, num_new_tokens)
        if grow > len(self._free):
            raise RuntimeError(
                f"KV cache exhausted: request {request.request_id!r} needs {grow} more blocks, "
                f"{len(self._free)} free of {self.num_blocks}"
            )
        request.block_ids.extend(self._free.popleft() for _ in range(grow))

    def free(self, request: Request) -> None:
        """Return every block of ``request`` to the free list."""
        self._free.extend(request.block_ids)
        request.block_ids = []
