"""The engine config decides the CUDA-graph mode the runner serves
(``EngineConfig.served_cudagraph_mode``, config/engine_graphs.py); vLLM's
``compilation_config.cudagraph_mode`` stays what vLLM's resolution leaves."""

from __future__ import annotations

import pytest

from forwardkit.config.attention import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION_BACKEND,
    AttentionCGSupport,
    attention_cudagraph_support,
    selected_attention_backend,
)
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.config.engine import EngineConfig
from forwardkit.config.model import ModelConfig
from forwardkit.platforms import CpuPlatform, CudaPlatform, Platform

M = CUDAGraphMode
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
}


class _Backend:
    """Stands for a registered backend class: the config reads name and support level only."""

    def __init__(self, name: str, support: AttentionCGSupport) -> None:
        self.name, self.cudagraph_support = name, support


@pytest.fixture
def capturing(monkeypatch):
    """Every platform can capture graphs now (as a GPU machine's CUDA platform)."""
    monkeypatch.setattr(Platform, "can_capture_graphs", lambda self: True)


@pytest.fixture
def backend(monkeypatch):
    """Register a stand-in backend 'STUB' with a given support level."""
    def register(support: AttentionCGSupport) -> str:
        monkeypatch.setitem(ATTENTION_BACKENDS, "STUB", _Backend("STUB", support))
        return "STUB"
    return register


def _cfg(platform: Platform | str = "cuda", enforce_eager: bool = False,
         attention_backend: str | None = None, **cc) -> EngineConfig:
    return EngineConfig(model_config=ModelConfig(hf_config=dict(LLAMA), max_model_len=64,
                                                 enforce_eager=enforce_eager),
                        compilation_config=cc or None, platform=platform,
                        attention_backend=attention_backend)


def test_the_selected_backend_is_resolved_into_the_config(monkeypatch):
    monkeypatch.delenv("FORWARDKIT_ATTENTION_BACKEND", raising=False)
    assert EngineConfig(platform="cpu").attention_backend == DEFAULT_ATTENTION_BACKEND == "TORCH_NATIVE"
    assert EngineConfig(platform="cpu", attention_backend="X").attention_backend == "X"
    monkeypatch.setenv("FORWARDKIT_ATTENTION_BACKEND", "FROM_ENV")
    assert selected_attention_backend() == "FROM_ENV"
    assert EngineConfig(platform="cpu").attention_backend == "FROM_ENV"


def test_cpu_serves_no_graphs():
    cfg = _cfg("cpu", mode=3)
    assert cfg.compilation_config.cudagraph_mode == M.NONE  # vLLM's resolution on CPU
    assert cfg.served_cudagraph_mode == M.NONE


def test_an_emulated_cuda_platform_keeps_vllms_mode_but_serves_none(monkeypatch):
    monkeypatch.setattr(CudaPlatform, "can_capture_graphs", lambda self: False)  # no GPU
    cfg = _cfg("cuda", mode=3)
    assert cfg.compilation_config.cudagraph_mode == M.FULL_AND_PIECEWISE  # as vLLM resolves it
    assert cfg.served_cudagraph_mode == M.NONE


@pytest.mark.parametrize("configured, support, expected", [
    ("FULL_AND_PIECEWISE", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, M.FULL_AND_PIECEWISE),
    ("FULL", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, M.FULL_AND_PIECEWISE),
    ("FULL", AttentionCGSupport.ALWAYS, M.FULL),
    ("FULL_AND_PIECEWISE", AttentionCGSupport.NEVER, M.PIECEWISE),
    ("PIECEWISE", AttentionCGSupport.NEVER, M.PIECEWISE),
])
def test_the_config_lowers_to_the_selected_backend(capturing, backend, configured, support, expected):
    name = backend(support)
    cfg = _cfg("cuda", mode=3, cudagraph_mode=configured, attention_backend=name)
    assert cfg.attention_backend == name
    assert cfg.compilation_config.cudagraph_mode == M.parse(configured)  # not lowered there
    assert cfg.served_cudagraph_mode == expected


def test_the_builtin_backend_decides_by_default(capturing, monkeypatch):
    monkeypatch.delenv("FORWARDKIT_ATTENTION_BACKEND", raising=False)
    import forwardkit.layers.attention_backend as layers_backend  # registers TORCH_NATIVE

    assert ATTENTION_BACKENDS["TORCH_NATIVE"] is layers_backend.TorchNativeAttentionBackend
    assert attention_cudagraph_support("TORCH_NATIVE") == AttentionCGSupport.UNIFORM_BATCH
    assert _cfg("cuda", mode=3, cudagraph_mode="FULL").served_cudagraph_mode == M.FULL_AND_PIECEWISE
    # speculative decoding (decode steps of 1 + k tokens per request) keeps its FULL decode
    # graphs: the backend serves uniform batches of any query length
    spec = EngineConfig(model_config=ModelConfig(hf_config=dict(LLAMA), max_model_len=64),
                        compilation_config={"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
                        platform="cuda", speculative_config={"num_speculative_tokens": 2})
    assert spec.uniform_decode_query_len == 3
    assert spec.served_cudagraph_mode == M.FULL_AND_PIECEWISE


def test_enforce_eager_serves_none(capturing, backend):
    cfg = _cfg("cuda", enforce_eager=True, attention_backend=backend(AttentionCGSupport.ALWAYS))
    assert cfg.served_cudagraph_mode == M.NONE


def test_full_without_any_support_is_an_error(capturing, backend):
    cfg = _cfg("cuda", mode=3, cudagraph_mode="FULL", attention_backend=backend(AttentionCGSupport.NEVER))
    with pytest.raises(ValueError, match="supports none"):
        _ = cfg.served_cudagraph_mode


def test_an_unregistered_backend_is_named_when_graphs_need_it(capturing):
    cfg = _cfg("cuda", mode=3, attention_backend="NOT_THERE")
    with pytest.raises(ValueError, match="attention backend 'NOT_THERE' is not registered"):
        _ = cfg.served_cudagraph_mode
    assert _cfg("cpu", attention_backend="NOT_THERE").served_cudagraph_mode == M.NONE  # not needed


def test_the_platform_object_owns_the_capture_capability():
    import torch

    assert CpuPlatform().can_capture_graphs() is False
    assert CudaPlatform(device_capability=90).can_capture_graphs() is torch.cuda.is_available()
