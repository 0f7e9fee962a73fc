"""Fixtures for layer tests: a fresh current engine config per test."""

from __future__ import annotations

import pytest


@pytest.fixture
def engine_config():
    """A default EngineConfig installed as the current config (layers register into it)."""
    from forwardkit.config.engine import EngineConfig, set_current_engine_config

    config = EngineConfig()
    with set_current_engine_config(config):
        yield config


@pytest.fixture(params=[[], ["-cpu_attention"]], ids=["native-decode", "torch-decode"])
def decode_path_config(request):
    """Like ``engine_config``, once with the ``cpu_attention`` custom op on (the default: on the
    CPU, attention layers attend decode requests with the native kernel) and once with
    ``"-cpu_attention"`` (the torch ops), so the attention tests cover both decode paths."""
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.config.engine import EngineConfig, set_current_engine_config

    config = EngineConfig(compilation_config=CompilationConfig(custom_ops=list(request.param)))
    with set_current_engine_config(config):
        yield config
