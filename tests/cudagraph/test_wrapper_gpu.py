"""CUDAGraphWrapper with real CUDA graphs: capture at several sizes, replay matches eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.cudagraph import monitor
from forwardkit.cudagraph.wrapper import (
    CUDAGraphWrapper,
    piecewise_cudagraph_options,
    weak_ref_tensors,
)
from forwardkit.forward_context import BatchDescriptor as d
from forwardkit.forward_context import set_forward_context
from forwardkit.platforms import CudaPlatform, use_platform

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

M = CUDAGraphMode
SIZES = [1, 2, 4, 8]
HIDDEN = 16
CFG = EngineConfig()


def ctx(mode=M.NONE, desc=None):
    return set_forward_context(None, CFG, cudagraph_runtime_mode=mode, batch_descriptor=desc)


class CountingMLP(nn.Module):
    """Two linear layers with a GELU; counts eager forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture
def cuda_graphs():
    with use_platform(CudaPlatform()):
        monitor.set_cudagraph_capturing_enabled(True)
        yield
    monitor.set_cudagraph_capturing_enabled(True)


def capture_all(runnable, wrapper, buf, mode, descs):
    """What the runner does: eager warm-up, then capture, largest size first."""
    with monitor.capture_session():
        for desc in descs:
            n = desc.num_tokens
            with ctx(M.NONE):
                runnable(buf[:n])
            with ctx(mode, desc):
                wrapper(buf[:n])


@torch.inference_mode()
def test_full_graph_mlp_replay_matches_eager(cuda_graphs):
    torch.manual_seed(0)
    model = CountingMLP().cuda().eval()
    wrapper = CUDAGraphWrapper(model, CFG, M.FULL)
    buf = torch.zeros(max(SIZES), HIDDEN, device="cuda")
    before = compilation_counter.num_cudagraph_captured
    capture_all(model, wrapper, buf, M.FULL, [d(n) for n in reversed(SIZES)])
    assert compilation_counter.num_cudagraph_captured - before == len(SIZES)
    assert monitor.cudagraph_capturing_enabled is False
    assert all(e.cudagraph is not None for e in wrapper.concrete_cudagraph_entries.values())

    calls = model.calls
    for _ in range(2):
        for n in SIZES:
            x = torch.randn(n, HIDDEN, device="cuda")
            buf[:n].copy_(x)
            with ctx(M.FULL, d(n)):
                out = wrapper(buf[:n])
            got = out.clone()  # replay outputs live in the shared pool: copy before the next one
            assert got.shape == (n, HIDDEN)
            torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
            assert model.calls == calls + 1  # only the eager reference ran, not the wrapper
            calls = model.calls
    with ctx(M.NONE):  # NONE falls through to eager
        torch.testing.assert_close(wrapper(buf[:3]), model(buf[:3]))


@torch.inference_mode()
def test_piecewise_pieces_chain_through_the_pool(cuda_graphs, monkeypatch):
    monkeypatch.setenv("FORWARDKIT_LOGGING_LEVEL", "DEBUG")  # replay checks input addresses
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU()).cuda().eval()
    last = nn.Linear(4 * HIDDEN, HIDDEN).cuda().eval()
    pieces = [first, last]
    wrapped = [
        CUDAGraphWrapper(p, CFG, M.PIECEWISE, piecewise_cudagraph_options(i, len(pieces)))
        for i, p in enumerate(pieces)
    ]

    def model(x):
        return wrapped[1](wrapped[0](x))

    buf = torch.zeros(max(SIZES), HIDDEN, device="cuda")
    capture_all(model, model, buf, M.PIECEWISE, [d(n) for n in reversed(SIZES)])
    assert [len(w.concrete_cudagraph_entries) for w in wrapped] == [len(SIZES)] * 2
    for n in [3, 8, 1]:  # 3 pads to 4 (the runner slices the padded buffer)
        padded = next(s for s in SIZES if s >= n)
        x = torch.randn(n, HIDDEN, device="cuda")
        buf[:n].copy_(x)
        buf[n:padded].zero_()
        with ctx(M.PIECEWISE, d(padded)):
            got = model(buf[:padded])[:n].clone()
        torch.testing.assert_close(got, last(first(x)), rtol=1e-4, atol=1e-5)
    with ctx(M.PIECEWISE, d(4)), pytest.raises(AssertionError, match="Input addresses for cudagraphs are different"):
        model(buf[:4].clone())


@torch.inference_mode()
def test_weak_ref_tensors_cuda():
    t = torch.randn(4, 4, device="cuda")
    storage = t.untyped_storage()
    uses = torch._C._storage_Use_Count(storage._cdata)
    w = weak_ref_tensors(t)
    assert torch._C._storage_Use_Count(storage._cdata) == uses
    assert w.device == t.device and w.data_ptr() == t.data_ptr()
    t.mul_(2)
    torch.testing.assert_close(w, t)
