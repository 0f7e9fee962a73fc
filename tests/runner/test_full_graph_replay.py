"""FULL CUDA graphs through the runner, simulated on CPU.

A fake graph backend "captures" by recording the model call with its argument tensors and
the forward context of the capture, and "replays" by re-running that call on the same
tensors under the captured context, writing into the captured output. That is what a real
CUDA graph does with memory: it reads the captured addresses (static input buffers, the
metadata tensors of the capture) and knows nothing of the current forward context. So the
replayed logits are only right if the runner refills the static buffers and the persistent
attention metadata in place.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from forwardkit.config.cache import CacheConfig
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig, set_current_engine_config
from forwardkit.config.frozen import unfrozen
from forwardkit.config.model import ModelConfig
from forwardkit.config.scheduler import SchedulerConfig
from forwardkit.cudagraph.wrapper import GraphBackend
from forwardkit.forward_context import get_forward_context, override_forward_context
from forwardkit.platforms import Platform
from forwardkit.runner import ModelRunner, StepBatch

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
}
BLOCK = 4


class _Graph:
    def __init__(self) -> None:
        self.call = None  # (fn, args, forward context) recorded during capture
        self.output = None
        self.replays = 0


# One output buffer for every graph, as a real graph pool gives it: a FULL graph's output goes
# back to the pool when its capture ends (the wrapper keeps a weak reference), so the next
# capture reuses that memory and each replay overwrites the output of the one before. A runner
# that read a graph's output after another graph replayed would show it here.
_POOL = torch.empty(0)


class _Recorder:
    graph: _Graph | None = None


class RecordingModel(nn.Module):
    """Pass-through model that tells the fake backend what a capture ran."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.inner(input_ids, positions)
        if _Recorder.graph is not None:
            _Recorder.graph.call = (self.inner, (input_ids, positions), get_forward_context())
            _Recorder.graph.output = out
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


class ReplayingBackend(GraphBackend):
    def graph_pool(self):
        return None

    def new_graph(self):
        return _Graph()

    @contextlib.contextmanager
    def capture(self, graph, pool):
        global _POOL
        _Recorder.graph = graph
        try:
            yield
        finally:
            _Recorder.graph = None
        # A real capture computes nothing: its output holds garbage until the first replay.
        out = graph.output
        if _POOL.numel() < out.numel():
            _POOL = torch.empty(out.numel(), dtype=out.dtype)
        out.set_(_POOL.untyped_storage(), 0, out.shape, out.stride())
        out.fill_(float("nan"))

    def replay(self, graph):
        graph.replays += 1
        fn, args, ctx = graph.call
        with override_forward_context(ctx):
            graph.output.copy_(fn(*args))

    def weak_ref(self, output):
        return output


def _config(graphs: bool) -> EngineConfig:
    cfg = EngineConfig(
        model_config=ModelConfig(hf_config=dict(LLAMA), max_model_len=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=32),
        compilation_config={"mode": 0},
        optimization_level=0,
    )
    if graphs:
        cc = cfg.compilation_config
        with unfrozen(cfg):  # graphs on the CPU: resolution would turn them off
            cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
            cc.cudagraph_capture_sizes = [1, 2, 4]
            cc.max_cudagraph_capture_size = 4
            cc.compute_bs_to_padded_graph_size()
    return cfg


def _build(graphs: bool) -> ModelRunner:
    from forwardkit.models.loader import load_model

    cfg = _config(graphs)
    with set_current_engine_config(cfg):
        model = load_model(cfg)
    return ModelRunner(cfg, model=RecordingModel(model) if graphs else model)


def _tables(seq_lens, firsts):
    return [list(range(b, b + -(-s // BLOCK))) for s, b in zip(seq_lens, firsts)]


STEPS = [
    # prefill (mixed lengths -> eager), then uniform decode steps of 3 (padded to 4) and 2 requests
    StepBatch(["a", "b", "c"], [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]],
              [0, 0, 0], _tables([5, 7, 2], [0, 10, 20])),
    StepBatch(["a", "b", "c"], [[30], [31], [32]], [5, 7, 2], _tables([6, 8, 3], [0, 10, 20])),
    StepBatch(["a", "b", "c"], [[33], [34], [35]], [6, 8, 3], _tables([7, 9, 4], [0, 10, 20])),
    StepBatch(["a", "c"], [[36], [37]], [7, 4], _tables([8, 5], [0, 20])),
    StepBatch(["c"], [[38]], [5], _tables([6], [20])),
]
MODES = [CUDAGraphMode.NONE] + [CUDAGraphMode.FULL] * 4
PADDED = [14, 4, 4, 2, 1]


@pytest.fixture
def replaying_backend(monkeypatch):
    for name in ("graph_pool", "new_graph", "capture", "replay", "weak_ref"):
        monkeypatch.setattr(GraphBackend, name, getattr(ReplayingBackend, name))
    monkeypatch.setattr(Platform, "can_capture_graphs", lambda self: True)
    monkeypatch.setitem(globals(), "_POOL", torch.empty(0))  # a fresh pool per test


def test_full_graph_replay_matches_eager(replaying_backend):
    eager = _build(graphs=False)
    graphed = _build(graphs=True)
    assert graphed.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    graphed.capture_model()
    entries = graphed.model.concrete_cudagraph_entries
    assert sorted(d.num_tokens for d in entries) == [1, 2, 4]
    assert all(d.uniform for d in entries)
    for batch, mode, padded in zip(STEPS, MODES, PADDED):
        expected = eager.execute(batch)
        got = graphed.execute(batch)
        assert (graphed.last_step.mode, graphed.last_step.num_padded_tokens) == (mode, padded)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # No capture happened after capture_model: every FULL step replayed its graph (padded
    # sizes 4, 4, 2, 1), none ran eagerly in its place.
    assert sorted(d.num_tokens for d in entries) == [1, 2, 4]
    replays = {d.num_tokens: e.cudagraph.replays for d, e in entries.items()}
    assert replays == {4: 2, 2: 1, 1: 1}


def test_replay_needs_persistent_metadata(replaying_backend, monkeypatch):
    """Control: with fresh metadata objects per step the fake replay reads the capture's
    metadata and goes wrong, so the test above really checks the persistent metadata."""
    from forwardkit.runner.static_metadata import StaticMetadataPool

    monkeypatch.setattr(StaticMetadataPool, "update", lambda self, n, md: md)
    eager = _build(graphs=False)
    graphed = _build(graphs=True)
    graphed.capture_model()
    eager.execute(STEPS[0])
    graphed.execute(STEPS[0])
    expected = eager.execute(STEPS[1])
    got = graphed.execute(STEPS[1])
    assert graphed.last_step.mode == CUDAGraphMode.FULL
    assert not torch.allclose(got, expected, rtol=1e-3, atol=1e-3)
