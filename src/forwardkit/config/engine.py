"""``EngineConfig`` (the ``VllmConfig`` analogue) and the current-config context.

Work in progress: this first version holds the sub-configs and the current-config context;
the ordered resolution of spec/config.md §5.3 follows.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from forwardkit.config.cache import CacheConfig
from forwardkit.config.model import ModelConfig
from forwardkit.config.parallel import ParallelConfig
from forwardkit.config.scheduler import SchedulerConfig
from forwardkit.logger import init_logger
from forwardkit.platforms import current_platform

__all__ = ["EngineConfig", "get_current_engine_config", "set_current_engine_config"]

logger = init_logger(__name__)


class _PendingCompilationConfig:
    """Placeholder until ``forwardkit.config.compilation.CompilationConfig`` lands."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)
        self.static_forward_context: dict[str, Any] = {}


def _compilation_config(value: Any) -> Any:
    try:
        from forwardkit.config.compilation import CompilationConfig  # type: ignore[attr-defined]
    except ImportError:
        return value if value is not None and not isinstance(value, dict) else _PendingCompilationConfig(**(value or {}))
    if value is None:
        return CompilationConfig()
    if isinstance(value, dict):
        return CompilationConfig(**value)
    return value


@dataclass(config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))
class EngineConfig:
    """Every config of one engine instance (vLLM's ``VllmConfig``)."""

    model_config: ModelConfig | None = None
    """The model; None = no model (resolution treats that like vLLM does)."""
    parallel_config: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel layout."""
    scheduler_config: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Batch limits."""
    cache_config: CacheConfig = Field(default_factory=CacheConfig)
    """Paged KV cache."""
    compilation_config: Any = None
    """``CompilationConfig`` (a dict is accepted)."""
    speculative_config: Any = None
    """Speculative decoding (None or an object with ``num_speculative_tokens``)."""
    lora_config: Any = None
    """LoRA (not supported; always None)."""
    optimization_level: int = 2
    """O0..O3."""
    platform: Any = None
    """The platform; None = ``forwardkit.platforms.current_platform``."""
    instance_id: str = ""
    """Unique id of this engine instance."""

    def __post_init__(self) -> None:
        if self.platform is None:
            self.platform = current_platform._get()
        self.compilation_config = _compilation_config(self.compilation_config)
        if not self.instance_id:
            self.instance_id = str(time.time_ns())


_CURRENT: contextvars.ContextVar[EngineConfig | None] = contextvars.ContextVar(
    "forwardkit_current_engine_config", default=None
)


@contextlib.contextmanager
def set_current_engine_config(config: EngineConfig) -> Iterator[EngineConfig]:
    """Make ``config`` the current engine config (while building a model); restores on exit."""
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)


def get_current_engine_config() -> EngineConfig:
    """The current engine config; a fresh default ``EngineConfig()`` (and a warning) if none."""
    config = _CURRENT.get()
    if config is None:
        logger.warning_once(
            "get_current_engine_config() called outside set_current_engine_config(); "
            "using a default EngineConfig()."
        )
        return EngineConfig()
    return config
