"""Configuration: compilation, parallel, scheduler, model, cache and the engine config.

``EngineConfig`` (vLLM's ``VllmConfig``) resolves them together; see
``forwardkit.config.engine``. ``build_engine_config`` (``forwardkit.config.builder``) builds
one from flat arguments (``LLM(...)`` keywords and CLI flags share it). Parsing CLI flags is
the command layer's work (``forwardkit/commands/``), not this package's.
"""

from forwardkit.config.builder import build_engine_config
from forwardkit.config.cache import CacheConfig
from forwardkit.config.compilation import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    DynamicShapesConfig,
    DynamicShapesType,
    PassConfig,
    Range,
)
from forwardkit.config.engine import (
    EngineConfig,
    OptimizationLevel,
    get_current_engine_config,
    get_current_engine_config_or_none,
    get_layers_from_engine_config,
    set_current_engine_config,
)
from forwardkit.config.model import ModelConfig
from forwardkit.config.parallel import EPLBConfig, ParallelConfig
from forwardkit.config.scheduler import SchedulerConfig, SpeculativeConfig

__all__ = [
    "CUDAGraphMode",
    "CacheConfig",
    "CompilationConfig",
    "CompilationMode",
    "DynamicShapesConfig",
    "DynamicShapesType",
    "EPLBConfig",
    "EngineConfig",
    "ModelConfig",
    "OptimizationLevel",
    "ParallelConfig",
    "PassConfig",
    "Range",
    "SchedulerConfig",
    "SpeculativeConfig",
    "build_engine_config",
    "get_current_engine_config",
    "get_current_engine_config_or_none",
    "get_layers_from_engine_config",
    "set_current_engine_config",
]
