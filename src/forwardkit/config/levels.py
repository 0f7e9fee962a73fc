"""Optimisation levels O0-O3 and the defaults each one fills in (vLLM 0.14.0's table).

The table is walked against the engine config: a dict whose target is a dataclass is walked
recursively, every leaf goes through :func:`set_default`, so values the user set (not None)
always win. Also holds the default cudagraph capture-size pattern.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from forwardkit.config.compilation import CUDAGraphMode

if TYPE_CHECKING:
    from forwardkit.config.engine import EngineConfig

__all__ = ["OptimizationLevel", "apply_level_defaults", "default_capture_sizes", "set_default"]


class OptimizationLevel(enum.IntEnum):
    """How hard the engine optimises: O0 eager ... O3 (currently the same as O2)."""

    O0 = 0
    O1 = 1
    O2 = 2
    O3 = 3

    def __str__(self) -> str:
        return self.name


def _norm_fusion(cfg: EngineConfig) -> bool:
    cc = cfg.compilation_config
    return cc.is_custom_op_enabled("rms_norm") or cc.is_custom_op_enabled("quant_fp8")


def _act_fusion(cfg: EngineConfig) -> bool:
    cc = cfg.compilation_config
    return cc.is_custom_op_enabled("silu_and_mul") or cc.is_custom_op_enabled("quant_fp8")


# vLLM 0.14.0 hard-codes "model is quantized" / "model is dense" to False in this table.
_IS_QUANTIZED = False
_IS_DENSE = False


def _level_defaults(level: OptimizationLevel) -> dict[str, Any]:
    """The defaults table for one level; leaves are values or ``fn(engine_config)``."""
    if level == OptimizationLevel.O0:
        flags: dict[str, Any] = dict.fromkeys(
            ("eliminate_noops", "fuse_norm_quant", "fuse_act_quant", "fuse_allreduce_rms",
             "fuse_attn_quant", "enable_sp", "fuse_gemm_comms", "fuse_rms_norm",
             "fuse_silu_and_mul"), False)
        mode = CUDAGraphMode.NONE
    else:
        late = level >= OptimizationLevel.O2
        flags = {
            "eliminate_noops": True,
            "fuse_norm_quant": _norm_fusion,
            "fuse_act_quant": _act_fusion,
            "fuse_allreduce_rms": False,
            "fuse_attn_quant": _IS_QUANTIZED if late else False,
            "enable_sp": _IS_DENSE if late else False,
            "fuse_gemm_comms": _IS_DENSE if late else False,
            # forwardkit's own fusions (no vLLM flag): on wherever no-op elimination is.
            "fuse_rms_norm": True,
            "fuse_silu_and_mul": True,
        }
        mode = CUDAGraphMode.FULL_AND_PIECEWISE if late else CUDAGraphMode.PIECEWISE
    return {"compilation_config": {"pass_config": flags, "cudagraph_mode": mode,
                                   "use_inductor_graph_partition": False}}


def set_default(cfg: EngineConfig, obj: Any, key: str, value: Any) -> None:
    """Set ``obj.key`` only when it is None: to ``value(cfg)`` if callable, else ``value``."""
    if getattr(obj, key) is None:
        setattr(obj, key, value(cfg) if callable(value) else value)


def apply_level_defaults(cfg: EngineConfig) -> None:
    """Fill the None fields of ``cfg`` (an EngineConfig) from its optimisation level's table."""
    _apply_table(cfg, cfg, _level_defaults(OptimizationLevel(cfg.optimization_level)))


def _apply_table(cfg: EngineConfig, obj: Any, table: dict[str, Any]) -> None:
    for key, value in table.items():
        current = getattr(obj, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            _apply_table(cfg, current, value)
        else:
            set_default(cfg, obj, key, value)


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default capture sizes up to ``max_size``: 1, 2, 4, then steps of 8, then 16."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    if max_size >= 8:
        sizes += range(8, min(max_size + 1, 256), 8)
    if max_size >= 256:
        sizes += range(256, max_size + 1, 16)
    return sizes
