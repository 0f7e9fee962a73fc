"""Batch-size forward-time statistics: the arithmetic behind forward-context telemetry.

The samples themselves live in :data:`forwardkit.forward_context.batchsize_forward_time`
(batch size -> list of milliseconds), because vLLM keeps them there and tests patch them
there; this module only summarises them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LOG_PREFIX", "format_summary", "quantile", "summarize"]

LOG_PREFIX = "Batchsize forward time stats (batchsize, count, median_time(ms)): "


def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile with linear interpolation (``torch.quantile``'s default method).

    ``samples`` need not be sorted; raises ``ValueError`` when empty or ``q`` is outside
    ``[0, 1]``.
    """
    if not samples:
        raise ValueError("quantile() of an empty sample list")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(samples)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(store: Mapping[Any, Sequence[float]]) -> dict[Any, dict[str, float]]:
    """Per batch size: ``count``, ``median_ms``, ``p99_ms``, ``mean_ms`` (sizes with samples)."""
    out: dict[Any, dict[str, float]] = {}
    for size, times in list(store.items()):
        times = list(times)  # snapshot: other threads may append meanwhile
        if not times:
            continue
        out[size] = {
            "count": len(times),
            "median_ms": quantile(times, 0.5),
            "p99_ms": quantile(times, 0.99),
            "mean_ms": sum(times) / len(times),
        }
    return out


def format_summary(store: Mapping[Any, Sequence[float]]) -> str | None:
    """The periodic log line, or None when no batch size has more than one sample.

    Sizes with a single sample are skipped (those are assumed to be capture or profiling
    runs); the rest are ordered by sample count, most frequent first (ties keep first-seen
    order). The first part is vLLM's line verbatim (``(batchsize, count, median)`` with the
    median rounded to 2 decimals); forwardkit appends the p99 per size.
    """
    rows = []
    for size, times in list(store.items()):
        times = list(times)
        if len(times) > 1:
            rows.append((size, len(times), round(quantile(times, 0.5), 2),
                         round(quantile(times, 0.99), 2)))
    if not rows:
        return None
    rows.sort(key=lambda row: row[1], reverse=True)  # stable: ties keep insertion order
    medians = [(size, count, median) for size, count, median, _ in rows]
    p99s = [(size, p99) for size, _, _, p99 in rows]
    return f"{LOG_PREFIX}{medians}; p99_time(ms): {p99s}"
