"""The engine config that is current while a model is built (a ``contextvars.ContextVar``,
so threads and asyncio tasks building models concurrently each see their own)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = [
    "get_current_engine_config",
    "get_current_engine_config_or_none",
    "get_layers_from_engine_config",
    "set_current_engine_config",
]

logger = init_logger(__name__)

# ``EngineConfig``, set by ``forwardkit.config.engine`` when it is imported (importing it here
# would make the two modules import each other).
_default_factory: Callable[[], EngineConfig] | None = None

_CURRENT: contextvars.ContextVar[EngineConfig | None] = contextvars.ContextVar(
    "forwardkit_current_engine_config", default=None
)


@contextlib.contextmanager
def set_current_engine_config(config: EngineConfig, check_compile: bool = False) -> Iterator[EngineConfig]:
    """Make ``config`` current while a model is built; restores the previous one on exit.

    With ``check_compile``, a normal exit runs ``custom_op_log_check()`` (warns about
    ``custom_ops`` entries that named no op of the model).
    """
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)
    if check_compile:
        config.compilation_config.custom_op_log_check()


def get_current_engine_config_or_none() -> EngineConfig | None:
    """The current engine config, or None outside :func:`set_current_engine_config`."""
    return _CURRENT.get()


def get_current_engine_config() -> EngineConfig:
    """The current engine config; outside a context, a fresh default ``EngineConfig()``.

    The fallback is built anew on each call (like vLLM), so layers registered into it
    are not shared between models; a warning is logged once.
    """
    config = _CURRENT.get()
    if config is None:
        logger.warning_once(
            "get_current_engine_config() called outside set_current_engine_config(); "
            "using a default EngineConfig()."
        )
        if _default_factory is None:  # pragma: no cover - config.engine imports this module
            raise RuntimeError("forwardkit.config.engine is not imported")
        return _default_factory()
    return config


def get_layers_from_engine_config(config: EngineConfig, layer_type: type,
                                  layer_names: list[str] | None = None) -> dict[str, Any]:
    """Layers of ``static_forward_context`` that are instances of ``layer_type``."""
    ctx = config.compilation_config.static_forward_context
    names = list(ctx) if layer_names is None else layer_names
    return {name: ctx[name] for name in names if isinstance(ctx[name], layer_type)}
