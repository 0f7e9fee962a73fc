"""CUDAGraphWrapper decisions on CPU with a fake graph backend (capture, replay, fall-through)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.cudagraph import monitor
from forwardkit.cudagraph.wrapper import (
    CUDAGraphEntry,
    CUDAGraphOptions,
    CUDAGraphWrapper,
    GraphBackend,
    piecewise_cudagraph_options,
    weak_ref_tensors,
)
from forwardkit.forward_context import BatchDescriptor as d
from forwardkit.forward_context import set_forward_context
from forwardkit.platforms import CudaPlatform, use_platform

M = CUDAGraphMode
POOL = object()  # sentinel standing in for the platform's global graph pool


class Weak:
    """What the fake backend returns as a 'weak reference' (so tests can tell them apart)."""

    def __init__(self, value):
        self.value = value


class FakeGraph:
    def __init__(self) -> None:
        self.replays = 0


class FakeBackend(GraphBackend):
    """Records capture/replay events; 'captures' by running the body once."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list = []
        self.pools: list = []
        self.in_capture = False
        self.gc_collect_inside = None
        self.patched_inside: tuple = ()

    def new_graph(self):
        return FakeGraph()

    @contextlib.contextmanager
    def capture(self, graph, pool):
        self.pools.append(pool)
        self.events.append("enter")
        self.gc_collect_inside = gc.collect()  # the real capture context calls this on entry
        torch.cuda.empty_cache()  # ... and this (a no-op on CPU, patched when gc_disable)
        self.patched_inside = (gc.collect, torch.cuda.empty_cache)
        self.in_capture = True
        try:
            yield
        finally:
            self.in_capture = False
            self.events.append("exit")

    def replay(self, graph):
        graph.replays += 1
        self.events.append("replay")

    def weak_ref(self, output):
        self.events.append("weak_ref")
        return Weak(output)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Emulated CUDA platform whose global graph pool is the POOL sentinel; capture allowed."""
    monkeypatch.setattr(CudaPlatform, "_global_graph_pool", POOL)
    monitor.set_cudagraph_capturing_enabled(True)
    with use_platform(CudaPlatform(device_capability=90)):
        yield
    monitor.set_cudagraph_capturing_enabled(True)


CFG = EngineConfig()


def ctx(mode=M.NONE, desc=None):
    return set_forward_context(None, CFG, cudagraph_runtime_mode=mode, batch_descriptor=desc)


class Doubler:
    """Runnable ``x * 2`` that counts calls and notes whether it ran inside a capture."""

    def __init__(self, backend: FakeBackend | None = None) -> None:
        self.calls = 0
        self.inside_capture: list[bool] = []
        self.backend = backend
        self.hidden_size = 7

    def __call__(self, x, scale=None):
        self.calls += 1
        if self.backend is not None:
            self.inside_capture.append(self.backend.in_capture)
        return x * 2


def make(mode=M.FULL, options=None, **kw):
    backend = FakeBackend()
    runnable = Doubler(backend)
    wrapper = CUDAGraphWrapper(runnable, CFG, mode, options, graph_backend=backend, **kw)
    return wrapper, runnable, backend


def test_captures_are_counted_per_backend(fake_cuda):
    """Each graph backend (one per runner) counts its own captures per runtime mode; the
    process-wide total (vLLM's counter) counts all of them."""
    full, _, backend_a = make(M.FULL)
    piece, _, backend_b = make(M.PIECEWISE)
    before = compilation_counter.num_cudagraph_captured
    for n in (4, 8):
        with ctx(M.FULL, d(n)):
            full(torch.ones(n))
    with ctx(M.PIECEWISE, d(4)):
        piece(torch.ones(4))
    with ctx(M.FULL, d(4)):
        full(torch.ones(4))  # a replay counts nothing
    assert backend_a.captured == {"FULL": 2}
    assert backend_b.captured == {"PIECEWISE": 1}
    assert compilation_counter.num_cudagraph_captured - before == 3


def test_capture_replay_and_fallthrough_sequence(fake_cuda):
    wrapper, fn, backend = make(options=CUDAGraphOptions(weak_ref_output=False))
    x = torch.ones(4)
    before = compilation_counter.num_cudagraph_captured

    with ctx(M.NONE):  # 1. NONE: fall through
        assert torch.equal(wrapper(x), x * 2)
    assert fn.calls == 1 and wrapper.concrete_cudagraph_entries == {}

    with ctx(M.PIECEWISE, d(4)):  # 2. other mode: fall through
        wrapper(x)
    assert fn.calls == 2 and wrapper.concrete_cudagraph_entries == {}

    with ctx(M.FULL, d(4)):  # 3. capture into the platform's global pool
        out = wrapper(x)
    assert fn.calls == 3 and fn.inside_capture[-1] is True
    assert backend.pools == [POOL]
    assert torch.equal(out, torch.full((4,), 2.0))  # the strong output (weak_ref_output False)
    assert list(wrapper.concrete_cudagraph_entries) == [d(4)]
    entry = wrapper.concrete_cudagraph_entries[d(4)]
    assert isinstance(entry.output, Weak) and entry.output.value is out  # stored weakly
    assert entry.input_addresses == [x.data_ptr()]

    with ctx(M.FULL, d(4)):  # 4. replay: runnable not called, stored output returned
        replayed = wrapper(x)
    assert fn.calls == 3
    assert replayed is entry.output and torch.equal(replayed.value, torch.full((4,), 2.0))
    assert entry.cudagraph.replays == 1

    with ctx(M.FULL, d(4, 4, True)):  # 5. new descriptor: new entry and capture
        wrapper(x)
    assert len(wrapper.concrete_cudagraph_entries) == 2
    assert compilation_counter.num_cudagraph_captured - before == 2
    assert backend.pools == [POOL, POOL]


def test_debug_mode_checks_input_addresses(fake_cuda, monkeypatch):
    monkeypatch.setenv("FORWARDKIT_LOGGING_LEVEL", "DEBUG")
    wrapper, fn, _ = make()
    assert wrapper.is_debugging_mode
    x = torch.ones(4)
    with ctx(M.FULL, d(4)):
        wrapper(x)
        wrapper(x)  # same storage: fine
        with pytest.raises(AssertionError, match=r"^Input addresses for cudagraphs are different during replay\. Expected \[\d+\], got \[\d+\]"):
            wrapper(torch.ones(4))


def test_debug_check_off_without_debug_level(fake_cuda, monkeypatch):
    monkeypatch.setenv("FORWARDKIT_LOGGING_LEVEL", "INFO")
    wrapper, _, backend = make()
    with ctx(M.FULL, d(4)):
        wrapper(torch.ones(4))
        wrapper(torch.ones(4))
    assert backend.events[-1] == "replay"


def test_debug_check_ignores_keyword_tensors(fake_cuda, monkeypatch):
    """As in vLLM: only positional tensors are recorded and compared."""
    monkeypatch.setenv("FORWARDKIT_LOGGING_LEVEL", "DEBUG")
    wrapper, _, backend = make()
    with ctx(M.FULL, d(4)):
        wrapper(x=torch.ones(4))
        wrapper(x=torch.ones(4))
    assert wrapper.concrete_cudagraph_entries[d(4)].input_addresses == []
    assert backend.events[-1] == "replay"


def test_capture_outside_capture_session_raises(fake_cuda):
    wrapper, fn, _ = make()
    monitor.set_cudagraph_capturing_enabled(False)
    with ctx(M.FULL, d(8)), pytest.raises(
        RuntimeError,
        match=r"^CUDA graph capturing detected at an inappropriate time\. This operation is currently disabled\.$",
    ):
        wrapper(torch.ones(8))
    assert fn.calls == 0
    assert wrapper.concrete_cudagraph_entries[d(8)] == CUDAGraphEntry(
        batch_descriptor=d(8), cudagraph=None, output=None, input_addresses=None
    )
    monitor.set_cudagraph_capturing_enabled(True)
    with ctx(M.FULL, d(8)):  # a later call tries again
        wrapper(torch.ones(8))
    assert wrapper.concrete_cudagraph_entries[d(8)].cudagraph is not None


def test_missing_batch_descriptor_raises(fake_cuda):
    wrapper, _, _ = make()
    with ctx(M.FULL, None), pytest.raises(AssertionError, match="no batch_descriptor"):
        wrapper(torch.ones(4))


def test_needs_forward_context():
    wrapper, _, _ = make()
    with pytest.raises(Exception, match="set_forward_context"):
        wrapper(torch.ones(4))


def test_construction_checks_and_attribute_fallthrough():
    assert repr(CUDAGraphOptions()) == "CUDAGraphOptions(debug_log_enable=True, gc_disable=False, weak_ref_output=True)"
    with pytest.raises(AssertionError, match="got NONE"):
        CUDAGraphWrapper(Doubler(), CFG, M.NONE)
    with pytest.raises(ValueError, match="FULL_AND_PIECEWISE is a configuration mode"):
        CUDAGraphWrapper(Doubler(), CFG, M.FULL_AND_PIECEWISE)
    with pytest.raises(ValueError, match="runtime_mode must be CUDAGraphMode.PIECEWISE or CUDAGraphMode.FULL, got 'FULL'"):
        CUDAGraphWrapper(Doubler(), CFG, "FULL")
    with pytest.raises(ValueError, match="eager_warmups must be an int >= 0, got -1"):
        CUDAGraphWrapper(Doubler(), CFG, M.FULL, eager_warmups=-1)
    fn = Doubler()
    wrapper = CUDAGraphWrapper(fn, CFG, M.FULL)  # no CUDA needed to construct
    assert wrapper.hidden_size == 7
    assert wrapper.unwrap() is fn
    with pytest.raises(AttributeError, match="^Attribute nope not exists in the runnable of cudagraph wrapper: "):
        _ = wrapper.nope


def test_weak_ref_output_inside_capture(fake_cuda):
    wrapper, _, backend = make(options=CUDAGraphOptions(weak_ref_output=True))
    with ctx(M.FULL, d(4)):
        out = wrapper(torch.ones(4))
    # weak-ref'ed inside the capture, and again for the stored entry after it
    assert backend.events == ["enter", "weak_ref", "exit", "weak_ref"]
    assert isinstance(out, Weak) and torch.equal(out.value, torch.full((4,), 2.0))
    assert wrapper.concrete_cudagraph_entries[d(4)].output.value is out


def test_strong_output_without_weak_ref_option(fake_cuda):
    wrapper, _, backend = make(options=CUDAGraphOptions(weak_ref_output=False))
    with ctx(M.FULL, d(4)):
        out = wrapper(torch.ones(4))
    assert backend.events == ["enter", "exit", "weak_ref"]
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("gc_disable", [True, False])
def test_gc_disable_patches_collect_during_capture(fake_cuda, gc_disable):
    real_collect, real_empty = gc.collect, torch.cuda.empty_cache
    wrapper, _, backend = make(M.PIECEWISE, CUDAGraphOptions(gc_disable=gc_disable))
    with ctx(M.PIECEWISE, d(2)):
        wrapper(torch.ones(2))
    collect, empty = backend.patched_inside
    assert (collect is real_collect) is not gc_disable
    assert (empty is real_empty) is not gc_disable
    if gc_disable:
        assert backend.gc_collect_inside == 0
    assert gc.collect is real_collect and torch.cuda.empty_cache is real_empty  # restored


def test_eager_warmups_before_capture(fake_cuda):
    wrapper, fn, backend = make(eager_warmups=2)
    with ctx(M.FULL, d(4)):
        for _ in range(4):
            wrapper(torch.ones(4))
    assert fn.inside_capture == [False, False, True]  # 2 warm-ups, capture, then replay
    assert backend.events == ["enter", "weak_ref", "exit", "weak_ref", "replay"]


def test_nested_full_outer_and_piecewise_inner(fake_cuda):
    """Only the wrapper whose mode matches the step acts; the other passes through."""
    backend = FakeBackend()
    pieces = [Doubler(backend), Doubler(backend)]
    inner = [
        CUDAGraphWrapper(p, CFG, M.PIECEWISE, CUDAGraphOptions(weak_ref_output=i == 1), graph_backend=backend)
        for i, p in enumerate(pieces)
    ]

    def model(x):
        return inner[1](inner[0](x))

    outer = CUDAGraphWrapper(model, CFG, M.FULL, graph_backend=backend)
    x = torch.ones(4)
    with ctx(M.FULL, d(4, 4, True)):
        out = outer(x)
    assert torch.equal(out.value, torch.full((4,), 4.0))
    assert [w.concrete_cudagraph_entries for w in inner] == [{}, {}]
    assert list(outer.concrete_cudagraph_entries) == [d(4, 4, True)]

    with ctx(M.PIECEWISE, d(4)):
        outer(x)
    assert outer.concrete_cudagraph_entries.keys() == {d(4, 4, True)}
    assert [list(w.concrete_cudagraph_entries) for w in inner] == [[d(4)], [d(4)]]

    with ctx(M.NONE):
        assert torch.equal(outer(x), torch.full((4,), 4.0))
    assert [p.calls for p in pieces] == [3, 3]


def test_weak_ref_tensors_real():
    t = torch.arange(6.0).reshape(2, 3)[1:]
    storage = t.untyped_storage()
    uses = torch._C._storage_Use_Count(storage._cdata)
    w = weak_ref_tensors(t)
    assert torch._C._storage_Use_Count(storage._cdata) == uses  # does not keep it alive
    assert w.data_ptr() == t.data_ptr() and w.shape == t.shape and w.stride() == t.stride()
    t.add_(1)
    assert torch.equal(w, t)  # aliases the same memory

    a, b = torch.ones(2), torch.zeros(3)
    as_list = weak_ref_tensors([a, 5, b])
    assert isinstance(as_list, list) and as_list[1] == 5 and as_list[2].data_ptr() == b.data_ptr()
    as_tuple = weak_ref_tensors((a, None))
    assert isinstance(as_tuple, tuple) and as_tuple[1] is None

    class IntermediateTensors:
        def __init__(self, tensors):
            self.tensors = tensors

    it = weak_ref_tensors(IntermediateTensors({"hidden": a}))
    assert type(it) is IntermediateTensors and it.tensors["hidden"].data_ptr() == a.data_ptr()
    with pytest.raises(ValueError, match="^Invalid type for tensors"):
        weak_ref_tensors({"x": a})


def test_capture_session_toggles_guard_and_freezes_gc(monkeypatch):
    monkeypatch.delenv("FORWARDKIT_ENABLE_CUDAGRAPH_GC", raising=False)
    monitor.set_cudagraph_capturing_enabled(False)
    with monitor.capture_session():
        assert monitor.cudagraph_capturing_enabled is True
        assert gc.get_freeze_count() > 0
    assert monitor.cudagraph_capturing_enabled is False
    assert gc.get_freeze_count() == 0
    monitor.set_cudagraph_capturing_enabled(True)


def test_gc_freeze_off_with_env(monkeypatch):
    monkeypatch.setenv("FORWARDKIT_ENABLE_CUDAGRAPH_GC", "1")
    with monitor.freeze_gc_for_capture() as froze:
        assert froze is False and gc.get_freeze_count() == 0


def test_piecewise_options_by_position():
    assert [piecewise_cudagraph_options(i, 3) for i in range(3)] == [
        CUDAGraphOptions(debug_log_enable=True, gc_disable=False, weak_ref_output=False),
        CUDAGraphOptions(debug_log_enable=False, gc_disable=True, weak_ref_output=False),
        CUDAGraphOptions(debug_log_enable=False, gc_disable=True, weak_ref_output=True),
    ]
    assert piecewise_cudagraph_options(0, 1) == CUDAGraphOptions(True, False, True)
    with pytest.raises(ValueError, match=r"piece index must be an int in \[0, 2\), got 2"):
        piecewise_cudagraph_options(2, 2)
    with pytest.raises(ValueError, match="num_pieces must be a positive int, got 0"):
        piecewise_cudagraph_options(0, 0)
