"""Enums and the ``Range`` type of the compilation config (re-exported by ``compilation``).

``CompilationMode`` says how the model is compiled, ``CUDAGraphMode`` how CUDA graphs are
captured, ``DynamicShapesType`` how Dynamo treats dynamic dimensions, and ``Range`` is one
inclusive token-count range that Inductor compiles a graph for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["CUDAGraphMode", "CompilationMode", "DynamicShapesType", "Range"]


class CompilationMode(enum.IntEnum):
    """How the model is compiled (an int enum: ``CompilationMode.VLLM_COMPILE == 3``)."""

    NONE = 0
    """No torch.compile: the plain eager model."""
    STOCK_TORCH_COMPILE = 1
    """The ordinary torch.compile pipeline with the chosen backend."""
    DYNAMO_TRACE_ONCE = 2
    """Trace once with Dynamo and drop guards, so there is no re-compilation."""
    VLLM_COMPILE = 3
    """forwardkit's own piecewise Inductor backend with caching and custom passes."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def parse(cls, value: Any) -> CompilationMode:
        """Parse a member name (any case, e.g. ``"vllm_compile"``) or an int 0-3.

        Numeric strings are rejected like the reference does (``"3"`` is not a member name).
        Raises ``ValueError`` naming the bad value and the accepted ones.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                names = ", ".join(m.name for m in cls)
                raise ValueError(
                    f"Invalid compilation mode: {value}. Valid modes are: {names}"
                ) from None
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return cls(int(value)) if isinstance(value, (int, float)) else cls(value)
        except (ValueError, TypeError):
            raise ValueError(
                f"Invalid compilation mode: {value!r}. Valid modes are the integers 0-3 or "
                f"the names {', '.join(m.name for m in cls)}"
            ) from None


class CUDAGraphMode(enum.Enum):
    """How CUDA graphs are captured and replayed.

    Composite members (tuple values) give one mode for uniform-decode batches (element 0)
    and one for mixed prefill/decode batches (element 1). This is a plain enum, so
    ``CUDAGraphMode.FULL == 2`` is False; look members up by value with ``CUDAGraphMode(2)``
    or ``CUDAGraphMode((2, 1))``.
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def __str__(self) -> str:
        return self.name

    def separate_routine(self) -> bool:
        """True for composite modes (separate decode and mixed routines)."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        """The mode used for uniform-decode batches."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        """The mode used for mixed prefill/decode batches."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """Whether ``mode`` (a non-composite member) is one of this mode's routines."""
        if not isinstance(mode, CUDAGraphMode) or mode.separate_routine():
            raise AssertionError(
                f"has_mode() takes a non-composite CUDAGraphMode (NONE, PIECEWISE or FULL), "
                f"got {mode!r}"
            )
        if self.separate_routine():
            return mode.value in self.value
        return self == mode

    def requires_piecewise_compilation(self) -> bool:
        """True when a routine uses piecewise graphs (PIECEWISE, FULL_AND_PIECEWISE)."""
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        """The strongest routine: FULL over PIECEWISE over NONE."""
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        """True when some routine captures full graphs."""
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def has_piecewise_cudagraphs(self) -> bool:
        """True when some routine captures piecewise graphs."""
        return self.requires_piecewise_compilation()

    def valid_runtime_modes(self) -> bool:
        """True for the modes a single batch can run with: NONE, PIECEWISE, FULL."""
        return self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)

    @classmethod
    def parse(cls, value: Any) -> CUDAGraphMode:
        """Parse a member name (any case) or a value (``2``, ``(2, 1)``).

        Deliberate fix of a reference defect: an unknown name raises ``ValueError`` naming
        the bad value and the accepted names (the reference raises a bare ``KeyError``).
        """
        if isinstance(value, cls):
            return value
        names = ", ".join(m.name for m in cls)
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(
                    f"Invalid cudagraph_mode: {value!r}. Valid modes are: {names}"
                ) from None
        try:
            if isinstance(value, bool):
                raise ValueError
            return cls(value)
        except (ValueError, TypeError):
            raise ValueError(
                f"Invalid cudagraph_mode: {value!r}. Valid modes are the names {names} or the "
                f"values 0, 1, 2, (2, 0), (2, 1)"
            ) from None


class DynamicShapesType(str, enum.Enum):
    """How Dynamo treats the dynamic (token) dimension."""

    BACKED = "backed"
    """Backed symbolic sizes; guards may specialise on them."""
    UNBACKED = "unbacked"
    """Unbacked symbolic sizes; no specialisation at all."""
    BACKED_SIZE_OBLIVIOUS = "backed_size_oblivious"
    """Backed sizes, reasoned about size-obliviously (no 0/1 specialisation)."""


@dataclass(eq=True)
class Range:
    """An inclusive range ``[start, end]`` of token counts. No validation (``Range(5, 2)`` is empty)."""

    start: int
    end: int

    def __contains__(self, size: int) -> bool:
        return self.start <= size <= self.end

    def is_single_size(self) -> bool:
        """True when the range holds exactly one size."""
        return self.start == self.end

    def __hash__(self) -> int:
        return hash((self.start, self.end))

    def __str__(self) -> str:
        return f"({self.start}, {self.end})"

    __repr__ = __str__
