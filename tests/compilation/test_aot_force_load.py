"""``FORWARDKIT_FORCE_AOT_LOAD=1`` (vLLM: ``VLLM_FORCE_AOT_LOAD``): an empty AOT cache raises
``FileNotFoundError`` instead of tracing and compiling."""

from __future__ import annotations

import pytest
import torch
from toy_model import CompiledToyModel

from forwardkit.compilation.counters import compilation_counter


def test_empty_aot_cache_with_force_load_raises(make_config, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("FORWARDKIT_CACHE_ROOT", str(root))
    monkeypatch.setenv("FORWARDKIT_USE_AOT_COMPILE", "1")
    monkeypatch.setenv("FORWARDKIT_FORCE_AOT_LOAD", "1")
    monkeypatch.delenv("FORWARDKIT_DISABLE_COMPILE_CACHE", raising=False)
    traces = compilation_counter.num_dynamo_traces
    model = CompiledToyModel(engine_config=make_config(mode=3, backend="inductor"), num_layers=1, hidden=16)
    with pytest.raises(FileNotFoundError, match="FORWARDKIT_FORCE_AOT_LOAD=1 but the AOT compile cache .*"
                                                "torch_aot_compile.* has no loadable entry"):
        model(torch.randn(4, 16))
    assert compilation_counter.num_dynamo_traces == traces  # nothing was traced


def test_force_load_is_off_by_default(monkeypatch):
    from forwardkit import envs

    monkeypatch.delenv("FORWARDKIT_FORCE_AOT_LOAD", raising=False)
    assert envs.FORWARDKIT_FORCE_AOT_LOAD is False
    monkeypatch.setenv("FORWARDKIT_FORCE_AOT_LOAD", "maybe")
    with pytest.raises(ValueError, match="FORWARDKIT_FORCE_AOT_LOAD"):
        _ = envs.FORWARDKIT_FORCE_AOT_LOAD
