"""Lazily zeroed CPU buffers and the deferred huge-page move of loaded weights."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from forwardkit.layers import hugepages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux")


@pytest.mark.parametrize("numel", [100, (1 << 20) + 3, (5 << 20) + 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_zero_leaves_only_zeros_including_partial_end_pages(numel, dtype):
    stale = torch.full((numel + 4096,), 7, dtype=dtype)  # memory a new buffer may reuse
    del stale
    t = torch.empty(numel, dtype=dtype)
    t.fill_(3)
    assert hugepages.zero_(t) is t
    assert int(torch.count_nonzero(t)) == 0


def test_zero_of_an_offset_view_keeps_the_bytes_around_it():
    base = torch.full(((3 << 20) + 10,), 5.0)
    view = base[7:-3]  # not page-aligned at either end
    hugepages.zero_(view)
    assert int(torch.count_nonzero(view)) == 0
    assert torch.equal(base[:7], torch.full((7,), 5.0))
    assert torch.equal(base[-3:], torch.full((3,), 5.0))


def test_zero_falls_back_for_strided_and_meta_tensors():
    t = torch.full((2048, 1024), 2.0).t()  # not contiguous
    assert int(torch.count_nonzero(hugepages.zero_(t))) == 0
    hugepages.zero_(torch.empty(1 << 20, device="meta"))  # no error, nothing to touch


@linux
def test_deferred_collapse_waits_for_the_start_and_skips_freed_tensors():
    hugepages.start_deferred_collapse()  # whatever earlier tests queued
    kept = [torch.nn.Parameter(torch.randn(1 << 20)) for _ in range(2)]  # 4 MiB each
    dropped = torch.nn.Parameter(torch.randn(1 << 20))
    expected = [p.detach().clone() for p in kept]
    hugepages.defer_collapse([*kept, dropped])
    assert hugepages.pending_collapse_bytes() == 3 * (4 << 20)
    del dropped
    gc.collect()
    assert hugepages.pending_collapse_bytes() == 2 * (4 << 20)  # the queue holds no reference
    thread = hugepages.start_deferred_collapse()
    assert hugepages.pending_collapse_bytes() == 0
    if thread is not None:
        thread.join(timeout=60)
        assert not thread.is_alive()
    for p, e in zip(kept, expected):
        assert torch.equal(p.detach(), e)
    assert hugepages.start_deferred_collapse() is None  # nothing left


def test_runner_starts_the_move_after_its_first_step_not_during_start_up():
    from forwardkit import LLM, SamplingParams

    hugepages.start_deferred_collapse()
    llm = LLM(enforce_eager=True)  # the built-in model, loaded with the CPU fast paths
    if llm.runner.device.type != "cpu":
        pytest.skip("the deferred move is for CPU weights")
    queued = hugepages.pending_collapse_bytes()
    assert queued == sum(p.untyped_storage().nbytes() for p in llm.runner.model.parameters()) > 0
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=1),
                 use_tqdm=False)
    assert hugepages.pending_collapse_bytes() == 0


def test_kv_cache_starts_zeroed():
    from forwardkit import LLM

    llm = LLM(enforce_eager=True)
    for cache in llm.runner.kv_caches.values():
        assert int(torch.count_nonzero(cache)) == 0
