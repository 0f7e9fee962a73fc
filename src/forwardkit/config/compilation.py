"""The compilation config: ``CompilationConfig`` and its enums (work in progress).

The enums and ``Range`` live in :mod:`forwardkit.config.compilation_enums`; import them
from here.
"""

from __future__ import annotations

from forwardkit.config.compilation_enums import (
    CompilationMode,
    CUDAGraphMode,
    DynamicShapesType,
    Range,
)

__all__ = ["CUDAGraphMode", "CompilationMode", "DynamicShapesType", "Range"]
