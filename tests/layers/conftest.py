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
