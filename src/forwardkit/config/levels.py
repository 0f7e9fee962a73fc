"""Optimisation levels O0-O3 and the defaults each one fills in (vLLM 0.14.0's table).

The table is walked against the compilation config (every default vLLM's table sets lies
under its ``compilation_config``): a dict whose target is a dataclass is walked recursively,
every leaf goes through :func:`set_default`, so values the user set (not None) always win.
Nothing here takes the ``EngineConfig``, so this module does not import :mod:`.engine`. Also holds the default cudagraph capture-size pattern.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from forwardkit.config.compilation_enums import CUDAGraphMode

if TYPE_CHECKING:
    from forwardkit.config.compilation import CompilationConfig

__all__ = ["OptimizationLevel", "apply_level_defaults", "default_capture_sizes", "set_default"]


class OptimizationLevel(enum.IntEnum):
    """How hard the engine optimises: O0 eager ... O3 (currently the same as O2)."""

    O0 = 0
    O1 = 1
    O2 = 2
    O3 = 3

    def __str__(self) -> str:
        return self.name


def _norm_fusion(cc: CompilationConfig) -> bool:
    return cc.is_custom_op_enabled("rms_norm") or cc.is_custom_op_enabled("quant_fp8")


def _act_fusion(cc: CompilationConfig) -> bool:
    return cc.is_custom_op_enabled("silu_and_mul") or cc.is_custom_op_enabled("quant_fp8")


# vLLM 0.14.0 hard-codes "model is quantized" / "model is dense" to False in this table.
_IS_QUANTIZED = False
_IS_DENSE = False


def _level_defaults(level: OptimizationLevel) -> dict[str, Any]:
    """The defaults table for one level, relative to the compilation config (vLLM's table
    nests it under ``compilation_config``); leaves are values or ``fn(compilation_config)``."""
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
    return {"pass_config": flags, "cudagraph_mode": mode, "use_inductor_graph_partition": False}


def set_default(cc: CompilationConfig, obj: Any, key: str, value: Any) -> None:
    """Set ``obj.key`` only when it is None: to ``value(cc)`` if callable, else ``value``."""
    if getattr(obj, key) is None:
        setattr(obj, key, value(cc) if callable(value) else value)


def apply_level_defaults(cc: CompilationConfig, level: OptimizationLevel) -> None:
    """Fill the None fields of ``cc`` (and its pass config) from ``level``'s table."""
    _apply_table(cc, cc, _level_defaults(OptimizationLevel(level)))


def _apply_table(cc: CompilationConfig, obj: Any, table: dict[str, Any]) -> None:
    for key, value in table.items():
        current = getattr(obj, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            _apply_table(cc, current, value)
        else:
            set_default(cc, obj, key, value)


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default capture sizes up to ``max_size``: 1, 2, 4, then steps of 8, then 16."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    if max_size >= 8:
        sizes += range(8, min(max_size + 1, 256), 8)
    if max_size >= 256:
        sizes += range(256, max_size + 1, 16)
    return sizes
