"""The engine config that is current while a model is built (a ``contextvars.ContextVar``,
so threads and asyncio tasks building models concurrently each see their own).

The functions live in :mod:`.engine`, next to ``EngineConfig`` (outside a context the current
config is a default ``EngineConfig()``); this module re-exports them, so the import points one
way: ``current`` -> ``engine``.
"""

from __future__ import annotations

from forwardkit.config.engine import (
    get_current_engine_config,
    get_current_engine_config_or_none,
    get_layers_from_engine_config,
    set_current_engine_config,
)

__all__ = [
    "get_current_engine_config",
    "get_current_engine_config_or_none",
    "get_layers_from_engine_config",
    "set_current_engine_config",
]
