"""Pure size arithmetic behind ``CompilationConfig``: padding table, compile ranges,
spec-decode rounding of capture sizes.

These are plain functions of lists and ints, so the engine config, the dispatcher and
tests can use them without building a config.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from forwardkit.config.compilation_enums import Range
from forwardkit.config.utils import ConfigIndexError, ConfigTypeError

__all__ = [
    "MAX_CAPTURE_SIZE",
    "compile_ranges_from_split_points",
    "padded_graph_size_table",
    "round_up",
    "round_capture_sizes_for_spec_decode",
]

MAX_CAPTURE_SIZE = 1 << 16
"""Largest accepted CUDA-graph capture size (each size is one captured graph, and the
padding table has one entry per batch size up to the largest), so per-size structures stay
small for any accepted config."""


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``x``."""
    return ((x + multiple - 1) // multiple) * multiple


def padded_graph_size_table(capture_sizes: Sequence[int], max_size: int | None) -> list[int]:
    """Batch size -> padded capture size, for every batch size ``0..max_size``.

    ``table[0] = 0``; ``table[s] = s`` for each capture size; any other size maps to the
    smallest capture size above it (or ``max_size + 1`` when the largest capture size is
    below ``max_size``). Unlike the reference, an unsorted list is sorted here instead of
    giving a wrong table, and bad inputs raise errors that say what is wrong.
    """
    if not isinstance(max_size, int) or isinstance(max_size, bool):
        raise ConfigTypeError(
            f"max_cudagraph_capture_size must be an int to build the padding table, got "
            f"{max_size!r}; set it (or let the engine config resolve it) first"
        )
    sizes = sorted(capture_sizes)
    if sizes and sizes[0] < 0:
        raise ConfigIndexError(
            f"cudagraph_capture_sizes must be >= 0, got {sizes[0]} in {list(capture_sizes)}"
        )
    if sizes and sizes[-1] > max_size:
        raise ConfigIndexError(
            f"cudagraph_capture_sizes has {sizes[-1]}, above max_cudagraph_capture_size "
            f"({max_size}); every capture size must be <= the maximum"
        )
    table = [0] * (max_size + 1)
    for start, end in zip([0, *sizes], [*sizes, max_size + 1]):
        if start < end:
            table[start] = start
            table[start + 1 : end] = [end] * (end - start - 1)
    return table


def compile_ranges_from_split_points(points: Iterable[int] | None) -> list[Range]:
    """Inclusive ranges ``[1, p0], [p0 + 1, p1], ...`` from split points (duplicates dropped).

    ``None`` or ``[]`` gives ``[]``. A point of 0 gives ``Range(1, 0)`` (empty), as in the
    reference; the engine config rejects such points before they get here.
    """
    if points is None:
        return []
    p = sorted(set(points))
    return [Range(start=a + 1, end=b) for a, b in zip([0, *p[:-1]], p)]


def round_capture_sizes_for_spec_decode(
    capture_sizes: Sequence[int],
    max_size: int,
    uniform_decode_query_len: int,
    tensor_parallel_size: int,
    enable_sp: bool,
) -> tuple[list[int], int] | None:
    """Capture sizes rounded to multiples of the decode query length (and of the TP size
    under sequence parallelism), as ``(sizes, new_max)``; ``None`` when nothing changes.

    Raises ``ValueError`` when no size can satisfy both multiples, or when no size is left.
    """
    q = uniform_decode_query_len
    multiple = q
    if tensor_parallel_size > 1 and enable_sp:
        multiple = max(q, tensor_parallel_size)
        if multiple % q != 0 or multiple % tensor_parallel_size != 0:
            raise ValueError(
                f"Can't determine cudagraph shapes that are both a multiple of {q} "
                f"(num_speculative_tokens + 1, required by spec-decode) and {tensor_parallel_size} "
                "(tensor_parallel_size, required by sequence parallelism). Please adjust "
                "num_speculative_tokens or disable sequence parallelism (pass_config.enable_sp)."
            )
    if not capture_sizes or multiple <= 1:
        return None
    rounded = sorted({round_up(s, multiple) for s in capture_sizes if round_up(s, multiple) <= max_size})
    if not rounded and multiple <= max_size:
        rounded = [multiple]
    if not rounded:
        raise ValueError(
            f"No valid cudagraph sizes after rounding to multiple of {multiple} "
            f"(num_speculative_tokens ({q - 1}) + 1 or tp if sequence parallelism is enabled); "
            f"please adjust num_speculative_tokens ({q - 1}) or "
            f"max_cudagraph_capture_size ({max_size}) or "
            f"cudagraph_capture_sizes ({list(capture_sizes)})"
        )
    return rounded, rounded[-1]
