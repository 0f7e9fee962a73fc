"""The DBO hand-off helpers (``forwardkit.microbatching.overlap``) in one process: turn-taking, contexts,
receive hooks, failures at every yield point."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest
import torch

from forwardkit.forward_context import create_forward_context, get_forward_context
from forwardkit.microbatching.overlap import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    run_ubatches,
    set_ubatch_event_hook,
)
from forwardkit.microbatching.slices import UBatchSlice

CFG = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}),
                      parallel_config=SimpleNamespace(data_parallel_size=1))


def _ctx(tag):
    return create_forward_context({"tag": tag}, CFG)


def _ubatch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("forwardkit-ubatch")]


def test_helpers_are_no_ops_outside_micro_batches():
    called = []
    assert not dbo_enabled()
    assert dbo_current_ubatch_id() == 0
    dbo_yield()
    dbo_register_recv_hook(lambda: called.append(1))
    dbo_maybe_run_recv_hook()
    assert called == []


def test_turns_alternate_and_one_runs_at_a_time():
    log, running = [], [0]

    def fn(i, yields):
        def body():
            for k in range(yields + 1):
                running[0] += 1
                assert running[0] == 1, "two micro-batches computing at once"
                log.append((i, k))
                running[0] -= 1
                if k < yields:
                    dbo_yield()
            return i
        return body

    # micro-batch 0 yields 3 times, 1 only once: once 1 is done, 0 keeps its turn
    out = run_ubatches([fn(0, 3), fn(1, 1)], [_ctx(0), _ctx(1)])
    assert out == [0, 1]
    assert log == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (0, 3)]
    assert not _ubatch_threads()


def test_three_micro_batches_ring():
    log = []

    def fn(i):
        def body():
            log.append((i, dbo_current_ubatch_id(), dbo_enabled()))
            dbo_yield()
            log.append((i, dbo_current_ubatch_id(), dbo_enabled()))
        return body

    run_ubatches([fn(0), fn(1), fn(2)], [_ctx(i) for i in range(3)])
    assert log == [(i, i, True) for i in range(3)] * 2


def test_each_micro_batch_keeps_its_own_context_over_1000_steps():
    rng = random.Random(0)
    outer = _ctx("outer")
    from forwardkit.forward_context import override_forward_context

    with override_forward_context(outer):
        for step in range(1000):
            n = rng.choice([2, 2, 3])
            total = rng.randint(n, 64)
            cuts = sorted(rng.sample(range(1, total), n - 1))
            bounds = [0, *cuts, total]
            slices = [UBatchSlice(slice(a, b), slice(a, b)) for a, b in zip(bounds, bounds[1:])]
            contexts = [create_forward_context({"step": step, "ub": i}, CFG,
                                               ubatch_slices=[s]) for i, s in enumerate(slices)]
            yields = [rng.randint(0, 4) for _ in range(n)]

            def fn(i, yields=yields):
                def body():
                    seen = []
                    for _ in range(yields[i] + 1):
                        ctx = get_forward_context()
                        seen.append((ctx.attn_metadata["ub"], ctx.attn_metadata["step"],
                                     ctx.ubatch_slices[0].token_slice, dbo_current_ubatch_id()))
                        dbo_yield()
                    return seen
                return body

            results = run_ubatches([fn(i) for i in range(n)], contexts)
            for i, seen in enumerate(results):
                assert seen == [(i, step, slices[i].token_slice, i)] * (yields[i] + 1)
            assert get_forward_context() is outer  # the caller's context is untouched
    assert not _ubatch_threads()


def test_recv_hook_goes_to_the_next_micro_batch_and_runs_once():
    ran = []

    def ub0():
        dbo_register_recv_hook(lambda: ran.append(("hook of 0", dbo_current_ubatch_id())))
        dbo_yield()
        dbo_maybe_run_recv_hook()  # nothing registered for 0
        return len(ran)

    def ub1():
        dbo_maybe_run_recv_hook()
        dbo_maybe_run_recv_hook()
        return len(ran)

    assert run_ubatches([ub0, ub1], [_ctx(0), _ctx(1)]) == [1, 1]
    assert ran == [("hook of 0", 1)]


def test_grad_and_inference_mode_are_inherited():
    def fn():
        return torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    with torch.inference_mode():
        assert run_ubatches([fn, fn], [_ctx(0), _ctx(1)]) == [(True, False)] * 2
    with torch.no_grad():
        assert run_ubatches([fn, fn], [_ctx(0), _ctx(1)]) == [(False, False)] * 2


class Fault(Exception):
    pass


@pytest.mark.parametrize("yields", [2, 3])
def test_a_fault_at_every_yield_point_ends_the_step_with_that_fault(yields):
    """A micro-batch raising at its k-th yield point (k = 0 before any) ends the step with
    that exception; the sibling parked at a yield is released; pending hooks run; no thread is
    left; the next step runs normally."""
    for faulty in range(2):
        for point in range(yields + 1):
            events, drained = [], []

            def fn(i, faulty=faulty, point=point, drained=drained, events=events):
                def body():
                    for k in range(yields + 1):
                        if i == faulty and k == point:
                            raise Fault(f"ub{i} at {k}")
                        if k < yields:
                            dbo_register_recv_hook(lambda i=i, k=k: drained.append((i, k)))
                            dbo_yield()
                    events.append(("done", i))
                return body

            with pytest.raises(Fault, match=f"ub{faulty} at {point}"):
                run_ubatches([fn(0), fn(1)], [_ctx(0), _ctx(1)])
            assert not _ubatch_threads()
            assert ("done", faulty) not in events
            # nothing registered stays pending: the last hook each micro-batch set was run
            if point > 0 or faulty == 1:
                assert drained, (faulty, point)
            ok = run_ubatches([lambda: dbo_yield() or 0, lambda: 1], [_ctx(0), _ctx(1)])
            assert ok == [0, 1]


def test_fault_in_the_sibling_while_the_other_waits_at_its_last_yield():
    seen = []
    set_ubatch_event_hook(lambda i, e: seen.append((i, e)))
    try:
        def ub0():
            dbo_yield()
            dbo_yield()  # parked here when 1 raises
            seen.append("not reached")

        def ub1():
            dbo_yield()
            raise Fault("ub1")

        with pytest.raises(Fault, match="ub1"):
            run_ubatches([ub0, ub1], [_ctx(0), _ctx(1)])
    finally:
        set_ubatch_event_hook(None)
    assert "not reached" not in seen
    assert seen[:3] == [(0, "start"), (0, "yield"), (1, "start")]
    assert not _ubatch_threads()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_micro_batches_launch_on_the_callers_cuda_stream():
    side = torch.cuda.Stream()

    def fn():
        x = torch.ones(4, device="cuda")
        dbo_yield()
        return torch.cuda.current_stream() == side, (x * 2).sum().item()

    with torch.cuda.stream(side):
        out = run_ubatches([fn, fn], [_ctx(0), _ctx(1)])
    assert out == [(True, 8.0), (True, 8.0)]
