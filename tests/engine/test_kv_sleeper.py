"""``KVCacheSleeper``: wake_up gives back a zeroed cache, whatever the allocator returns."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.engine.weight_update import KVCacheSleeper


class _Runner:
    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.cudagraph_mode = CUDAGraphMode.NONE


@pytest.mark.parametrize("numel", [4096, 1 << 19])  # 16 KiB (plain zero_) and 2 MiB (madvise)
def test_wake_up_zeroes_the_cache_even_when_the_allocator_returns_dirty_memory(numel):
    caches = {f"layer.{i}": torch.full((numel,), 7.0) for i in range(2)}
    sleeper = KVCacheSleeper(_Runner(caches))
    assert sleeper.sleep() == 2 * numel * 4
    # Dirty the freed memory: blocks of the same size, filled and freed, are what the allocator
    # hands back next, so a wake-up that does not zero would see these values.
    for _ in range(4):
        junk = torch.full((numel,), 5.0)
        del junk
    assert sleeper.wake_up() == 2 * numel * 4
    for name, t in caches.items():
        assert t.untyped_storage().nbytes() == numel * 4
        assert int(t.count_nonzero()) == 0, name
