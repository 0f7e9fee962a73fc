"""Weight-update guards: ``KVCacheSleeper.wake_up`` gives back a zeroed cache whatever the
allocator returns; the global Inductor ``freezing`` flag refuses updates like the per-config one."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.engine.weight_update import (
    KVCacheSleeper,
    WeightUpdateError,
    freezing_reason,
    prepare_weight_update,
)


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


def test_global_inductor_freezing_flag_refuses_updates(make_checkpoint, monkeypatch):
    """``torch._inductor.config.freezing`` set process-wide folds the weights into constants as
    the per-config option does: an update must be refused, naming the global flag."""
    import torch._inductor.config as inductor_config

    from forwardkit.config.builder import build_engine_config
    from forwardkit.models.default import default_hf_config

    cfg = build_engine_config(make_checkpoint("llama_gqa_tied"),
                              default_hf_config=default_hf_config(),
                              compilation_config={"mode": 3, "backend": "inductor"})
    monkeypatch.setattr(inductor_config, "freezing", False)
    assert freezing_reason(cfg) is None
    monkeypatch.setattr(inductor_config, "freezing", True)
    assert freezing_reason(cfg) == "torch._inductor.config.freezing is set"
    model = torch.nn.Linear(2, 2)
    with pytest.raises(WeightUpdateError, match=r"torch\._inductor\.config\.freezing is set"):
        prepare_weight_update(cfg, model, [("weight", torch.zeros(2, 2))])
