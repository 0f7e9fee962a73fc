"""CUDA-graph usage metrics: one ``CUDAGraphStat`` per step and a Markdown summary table.

Mirrors vLLM 0.14.0's ``CUDAGraphStat`` / ``CUDAGraphLogging``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass

from forwardkit.logger import init_logger

__all__ = ["CUDAGraphLogging", "CUDAGraphStat"]

logger = init_logger(__name__)

_COLUMNS = ("Unpadded Tokens", "Padded Tokens", "Num Paddings", "Runtime Mode", "Count")


@dataclass(frozen=True)
class CUDAGraphStat:
    """How one step ran: real vs. padded token count and the runtime mode name."""

    num_unpadded_tokens: int
    num_padded_tokens: int
    num_paddings: int
    runtime_mode: str


class CUDAGraphLogging:
    """Collects ``CUDAGraphStat`` objects and renders them as a counted Markdown table."""

    def __init__(self, cg_mode: object, cg_capture_sizes: Iterable[int] | None) -> None:
        self.cg_mode = cg_mode
        self.cg_capture_sizes = list(cg_capture_sizes) if cg_capture_sizes else []
        self.stats: list[CUDAGraphStat] = []

    def reset(self) -> None:
        """Forget every observed stat."""
        self.stats = []

    def observe(self, stat: CUDAGraphStat) -> None:
        """Record one step's stat."""
        if not isinstance(stat, CUDAGraphStat):
            raise TypeError(f"observe() expects a CUDAGraphStat, got {type(stat).__name__}")
        self.stats.append(stat)

    def generate_metric_table(self) -> str:
        """Config header plus a table of distinct stats, most frequent first (ties: first seen)."""
        header = (
            "**CUDAGraph Config Settings:**\n\n"
            f"- Mode: {self.cg_mode}\n"
            f"- Capture sizes: {self.cg_capture_sizes}\n\n"
            "**CUDAGraph Stats:**\n\n"
        )
        # Counter keeps first-seen order and most_common() sorts stably by count.
        rows = [
            [str(v) for v in astuple(stat)] + [str(count)]
            for stat, count in Counter(self.stats).most_common()
        ]
        widths = [max(len(c) for c in col) for col in zip(_COLUMNS, *rows)]

        def line(cells: Iterable[str]) -> str:
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

        lines = [line(_COLUMNS), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        lines += [line(r) for r in rows]
        return header + "\n".join(lines) + "\n"

    def log(self, log_fn: Callable[[str], object] = logger.info) -> None:
        """Emit the table through ``log_fn`` and reset, if anything was observed."""
        if not self.stats:
            return
        log_fn(self.generate_metric_table())
        self.reset()
