"""Fixtures for the compilation tests: the toy model on sys.path and an engine-config factory."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def make_config():
    """``make_config(mode=3, backend="eager", **compilation_kwargs) -> EngineConfig``."""
    from forwardkit.config.compilation import CompilationConfig
    from forwardkit.config.engine import EngineConfig

    def make(mode: int = 3, backend: str = "eager", **kw: Any) -> Any:
        kw.setdefault("splitting_ops", ["fktest::attn"])
        kw.setdefault("compile_ranges_split_points", [8, 512])
        return EngineConfig(compilation_config=CompilationConfig(mode=mode, backend=backend, **kw))

    return make
