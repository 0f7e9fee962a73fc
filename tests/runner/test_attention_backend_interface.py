"""One attention-backend interface: a second backend is one class plus a registration, and both
the runner (metadata, graph mode) and the attention op (forward) go through it."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from forwardkit.config.cache import CacheConfig
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig, set_current_engine_config
from forwardkit.config.frozen import unfrozen
from forwardkit.config.model import ModelConfig
from forwardkit.config.scheduler import SchedulerConfig
from forwardkit.layers.attention import Attention
from forwardkit.layers.attention_backend import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayerSpec,
    AttentionMetadata,
    TorchNativeAttentionBackend,
    get_attention_backend,
    register_attention_backend,
)
from forwardkit.platforms import CpuPlatform, CudaPlatform
from forwardkit.runner import ModelRunner, StepBatch

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
}
BLOCK = 4


class CountingBackend(TorchNativeAttentionBackend):
    """A second backend: counts the calls it gets and delegates to the torch-native one."""

    name = "COUNTING"
    builds: ClassVar[int] = 0
    forwards: ClassVar[list[str]] = []

    @classmethod
    def build_metadata(cls, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], num_padded_tokens: int, block_size: int,
                       device: torch.device | str = "cpu",
                       max_num_blocks_per_req: int | None = None) -> AttentionMetadata:
        cls.builds += 1
        return super().build_metadata(query_lens, seq_lens, block_tables, num_padded_tokens,
                                      block_size, device, max_num_blocks_per_req)

    @classmethod
    def forward(cls, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                output: torch.Tensor) -> None:
        cls.forwards.append(layer.layer_name)
        super().forward(layer, query, key, value, kv_cache, metadata, output)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[CountingBackend]:
    """CountingBackend registered and selected by name; counters reset."""
    monkeypatch.setitem(ATTENTION_BACKENDS, CountingBackend.name, CountingBackend)
    monkeypatch.setenv("FORWARDKIT_ATTENTION_BACKEND", CountingBackend.name)
    monkeypatch.setattr(CountingBackend, "builds", 0)
    monkeypatch.setattr(CountingBackend, "forwards", [])
    return CountingBackend


def _config(cuda: bool = False, **cc: Any) -> EngineConfig:
    """An eager config; ``cuda``: graph settings resolved for an (emulated) CUDA platform, then
    run on the CPU platform (as in test_graph_modes)."""
    cfg = EngineConfig(
        model_config=ModelConfig(hf_config=dict(LLAMA), max_model_len=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=16),
        compilation_config={"mode": 0, **cc},
        platform=CudaPlatform(device_capability=90) if cuda else None,
    )
    if cuda:
        with unfrozen(cfg):
            cfg.platform = CpuPlatform()
    return cfg


def _batch() -> StepBatch:
    return StepBatch(["a", "b"], [[5, 6, 7], [9]], [0, 4], [[0], [1, 2]])


def _logits(runner: ModelRunner) -> torch.Tensor:
    return runner.execute(_batch())


def test_runner_metadata_and_layer_forward_go_through_the_selected_backend(counting, monkeypatch):
    torch.manual_seed(0)
    runner = ModelRunner(_config(), device="cpu")
    assert runner.attn_backend is counting
    layers = runner.attn_layer_names
    assert len(layers) == 2
    got = _logits(runner)
    assert counting.builds == 1  # one metadata per step, shared by every layer
    assert counting.forwards == layers  # each layer's op called the backend once
    counting.forwards.clear()
    _logits(runner)
    assert counting.builds == 2 and counting.forwards == layers

    # The same weights through the default backend give the same logits.
    monkeypatch.delenv("FORWARDKIT_ATTENTION_BACKEND")
    torch.manual_seed(0)
    reference = ModelRunner(_config(), device="cpu")
    assert reference.attn_backend is TorchNativeAttentionBackend
    torch.testing.assert_close(_logits(reference), got)
    assert counting.builds == 2


def test_default_backend_is_torch_native():
    assert get_attention_backend() is TorchNativeAttentionBackend
    assert get_attention_backend("TORCH_NATIVE") is TorchNativeAttentionBackend
    with set_current_engine_config(EngineConfig()):
        layer = Attention(4, 8, 1.0, prefix="x.attn")
        explicit = Attention(4, 8, 1.0, prefix="y.attn", backend=CountingBackend)
    assert layer.backend is TorchNativeAttentionBackend
    assert explicit.backend is CountingBackend


@pytest.mark.parametrize("support, configured, expected", [
    (AttentionCGSupport.ALWAYS, "FULL", CUDAGraphMode.FULL),
    (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, "FULL", CUDAGraphMode.FULL_DECODE_ONLY),
    (AttentionCGSupport.ALWAYS, "FULL_DECODE_ONLY", CUDAGraphMode.FULL_DECODE_ONLY),
    (AttentionCGSupport.NEVER, "FULL_DECODE_ONLY", CUDAGraphMode.NONE),
])
def test_runner_graph_mode_reads_the_backend_support_level(
        counting, recording_graphs, monkeypatch, support, configured, expected):
    monkeypatch.setattr(counting, "cudagraph_support", support)
    runner = ModelRunner(_config(cuda=True, cudagraph_mode=configured), device="cpu")
    assert runner.attn_cg_support is support
    assert isinstance(runner.attn_cg_support, AttentionCGSupport)
    assert runner.cudagraph_mode == expected


def test_runner_refuses_full_graphs_when_the_backend_supports_none(counting, recording_graphs,
                                                                    monkeypatch):
    monkeypatch.setattr(counting, "cudagraph_support", AttentionCGSupport.NEVER)
    with pytest.raises(ValueError, match="supports none"):
        ModelRunner(_config(cuda=True, cudagraph_mode="FULL"), device="cpu")


def test_registration_checks_the_interface():
    class NoName(AttentionBackend):
        cudagraph_support = AttentionCGSupport.NEVER

    class RawLevel(AttentionBackend):
        name = "RAW"
        cudagraph_support = 3  # type: ignore[assignment]

    with pytest.raises(ValueError, match="has no name"):
        register_attention_backend(NoName)
    with pytest.raises(TypeError, match="must be an AttentionCGSupport"):
        register_attention_backend(RawLevel)
    class NoForward(AttentionBackend):
        name = "NO_FORWARD"
        cudagraph_support = AttentionCGSupport.NEVER
        get_kv_cache_shape = TorchNativeAttentionBackend.get_kv_cache_shape
        build_metadata = TorchNativeAttentionBackend.build_metadata

    with pytest.raises(TypeError, match=r"NO_FORWARD does not implement \['forward'\]"):
        register_attention_backend(NoForward)
    assert "NO_FORWARD" not in ATTENTION_BACKENDS
    with pytest.raises(ValueError, match="unknown attention backend 'NOPE'; registered: "):
        get_attention_backend("NOPE")
    with pytest.raises(TypeError, match="must subclass AttentionBackend"):
        register_attention_backend(object)  # type: ignore[arg-type]
    assert "RAW" not in ATTENTION_BACKENDS


def test_layers_with_different_backends_are_refused():
    from forwardkit.layers.kv_cache import attention_backend_of

    with set_current_engine_config(EngineConfig()):
        a = Attention(4, 8, 1.0, prefix="a.attn")
        b = Attention(4, 8, 1.0, prefix="b.attn", backend=CountingBackend)
    assert attention_backend_of({"a": a}) is TorchNativeAttentionBackend
    with pytest.raises(ValueError, match=r"share one attention backend, found \['COUNTING', 'TORCH_NATIVE'\]"):
        attention_backend_of({"a": a, "b": b})


def test_the_runner_serves_the_mode_the_config_decided(counting, recording_graphs, monkeypatch):
    cfg = _config(cuda=True, cudagraph_mode="FULL")
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.FULL  # vLLM's value, as is
    assert cfg.served_cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY  # lowered by the config
    runner = ModelRunner(cfg, device="cpu")
    assert runner.cudagraph_mode == runner.planner.cudagraph_mode == cfg.served_cudagraph_mode
    assert runner.dispatcher.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY


def test_the_runner_refuses_layers_built_with_another_backend(counting, monkeypatch):
    from forwardkit.models.loader import load_model

    cfg = _config()
    assert cfg.attention_backend == "COUNTING"
    with set_current_engine_config(cfg):
        model = load_model(cfg)
    with unfrozen(cfg):  # as if the model had been built under another selection
        cfg.attention_backend = "TORCH_NATIVE"
    with pytest.raises(ValueError, match=r"attention layers use backend 'COUNTING' but the engine "
                                         r"config selected 'TORCH_NATIVE'"):
        ModelRunner(cfg, model=model, device="cpu")


def test_the_runner_refuses_graphs_on_a_device_the_platform_does_not_run(recording_graphs):
    cfg = EngineConfig(
        model_config=ModelConfig(hf_config=dict(LLAMA), max_model_len=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
        cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks=16),
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
        platform=CudaPlatform(device_capability=90),
    )
    assert cfg.served_cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    with pytest.raises(ValueError, match="serves CUDA graphs .* on platform 'cuda', but this "
                                         "runner's device is cpu"):
        ModelRunner(cfg, device="cpu")
