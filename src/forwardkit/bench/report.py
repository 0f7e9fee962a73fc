"""Figures and reports of ``forwardkit bench``: the summary table, JSON and the plot."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ContenderResult", "BenchReport", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class ContenderResult:
    """Per-step timings of one contender over the trace (after its first step)."""

    name: str
    startup_s: float = math.nan
    step_ms: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    padded_tokens: list[int] = field(default_factory=list)
    step_modes: list[str] = field(default_factory=list)  # CUDA-graph runtime mode of each step
    recompiles: int = 0
    # per step: milliseconds blocked waiting for collectives (DP coordination, MoE exchange)
    comm_wait_ms: list[float] = field(default_factory=list)
    ubatched_steps: int = 0  # steps run as micro-batches (dual-batch overlap)

    @property
    def mean_comm_wait_ms(self) -> float:
        """Mean time per step blocked on collectives ("exposed communication"), ms."""
        return statistics.fmean(self.comm_wait_ms) if self.comm_wait_ms else math.nan

    @property
    def median_step_ms(self) -> float:
        """Median step latency in milliseconds."""
        return statistics.median(self.step_ms) if self.step_ms else math.nan

    @property
    def p99_step_ms(self) -> float:
        """99th-percentile step latency in milliseconds."""
        return percentile(self.step_ms, 99)

    @property
    def tokens_per_s(self) -> float:
        """Real tokens processed per second of step time."""
        total = sum(self.step_ms)
        return sum(self.step_tokens) / (total / 1e3) if total > 0 else math.nan

    @property
    def padded_fraction(self) -> float:
        """Share of computed token rows that were padding."""
        padded = sum(self.padded_tokens)
        return (padded - sum(self.step_tokens)) / padded if padded else 0.0

    @property
    def graph_modes(self) -> dict[str, int]:
        """Steps per CUDA-graph runtime mode (FULL, PIECEWISE, NONE), most used first."""
        counts: dict[str, int] = defaultdict(int)
        for mode in self.step_modes:
            counts[mode] += 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def format_graph_modes(self) -> str:
        """The table cell: ``FULL 12/PIECEWISE 4/NONE 2`` (``-`` when not recorded)."""
        return "/".join(f"{m} {n}" for m, n in self.graph_modes.items()) or "-"

    def by_tokens(self) -> dict[int, list[float]]:
        """Step latencies grouped by the step's real token count."""
        groups: dict[int, list[float]] = defaultdict(list)
        for n, ms in zip(self.step_tokens, self.step_ms):
            groups[n].append(ms)
        return dict(groups)


@dataclass
class BenchReport:
    """Everything one ``forwardkit bench`` run measured."""

    contenders: dict[str, ContenderResult]
    platform: str
    config_hash: str
    trace: str
    baseline: str = "eager"
    batchsize_stats: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    machine: str = ""

    def speedup(self, name: str) -> float:
        """Baseline median over this contender's median (> 1: faster than the baseline)."""
        base = self.contenders.get(self.baseline)
        mine = self.contenders[name].median_step_ms
        if base is None or not mine or math.isnan(mine):
            return math.nan
        return base.median_step_ms / mine

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form written by ``--json``."""
        return {
            "contenders": {
                name: {
                    "median_step_ms": r.median_step_ms,
                    "p99_step_ms": r.p99_step_ms,
                    "tokens_per_s": r.tokens_per_s,
                    "speedup_vs_eager": self.speedup(name),
                    "startup_s": r.startup_s,
                    "recompiles": r.recompiles,
                    "padded_fraction": r.padded_fraction,
                    "steps": len(r.step_ms),
                    "graph_modes": r.graph_modes,
                    "mean_comm_wait_ms": r.mean_comm_wait_ms,
                    "median_comm_wait_ms": (statistics.median(r.comm_wait_ms)
                                            if r.comm_wait_ms else math.nan),
                    "ubatched_steps": r.ubatched_steps,
                }
                for name, r in self.contenders.items()
            },
            "platform": self.platform,
            "config_hash": self.config_hash,
            "trace": self.trace,
            "machine": self.machine,
            "batchsize_stats": {
                name: {str(k): v for k, v in sorted(stats.items())}
                for name, stats in self.batchsize_stats.items()
            },
        }

    def write_json(self, path: str) -> None:
        """Write :meth:`to_json` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=2, sort_keys=False)
            f.write("\n")

    def format_table(self) -> str:
        """The per-contender summary table shown on the terminal."""
        header = (
            f"{'contender':<16}{'median ms':>10}{'p99 ms':>10}{'tok/s':>11}{'vs eager':>10}"
            f"{'startup s':>11}{'recompiles':>11}{'padded':>8}  graph modes (steps)"
        )
        lines = [header, "-" * len(header)]
        for name, r in self.contenders.items():
            lines.append(
                f"{name:<16}{r.median_step_ms:>10.3f}{r.p99_step_ms:>10.3f}{r.tokens_per_s:>11.0f}"
                f"{self.speedup(name):>9.2f}x{r.startup_s:>11.2f}{r.recompiles:>11d}"
                f"{r.padded_fraction:>7.1%}  {r.format_graph_modes()}"
            )
        return "\n".join(lines)

    def format_comm_table(self) -> str:
        """Exposed communication per contender (time blocked waiting for collectives), or ""
        when no contender communicated (one rank)."""
        if not any(sum(r.comm_wait_ms) > 0 for r in self.contenders.values()):
            return ""
        lines = ["communication left exposed (time blocked waiting for collectives, per step)",
                 f"{'contender':<16}{'mean ms':>10}{'median ms':>11}{'share':>8}{'ubatched':>10}"]
        for name, r in self.contenders.items():
            share = sum(r.comm_wait_ms) / sum(r.step_ms) if sum(r.step_ms) else math.nan
            median = statistics.median(r.comm_wait_ms) if r.comm_wait_ms else math.nan
            lines.append(f"{name:<16}{r.mean_comm_wait_ms:>10.3f}{median:>11.3f}{share:>7.1%}"
                         f"{r.ubatched_steps:>6d}/{len(r.step_ms)}")
        return "\n".join(lines)

    def format_batchsize_table(self, name: str) -> str:
        """The forward context's per-batch-size timing table for one contender."""
        stats = self.batchsize_stats.get(name) or {}
        if not stats:
            return f"(no batch-size telemetry recorded for {name})"
        lines = [f"forward time by padded batch size ({name}, from forward-context telemetry)"]
        lines.append(f"{'tokens':>8}{'count':>8}{'median ms':>11}{'p99 ms':>10}")
        for size in sorted(stats):
            s = stats[size]
            lines.append(f"{size:>8}{int(s['count']):>8}{s['median_ms']:>11.3f}{s['p99_ms']:>10.3f}")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Draw median step latency by real token count for each contender (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise RuntimeError(
                "--plot needs matplotlib, which is not installed; "
                "install it with: pip install 'forwardkit[plot]'"
            ) from None
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, r in self.contenders.items():
            groups = r.by_tokens()
            xs = sorted(groups)
            ax.plot(xs, [statistics.median(groups[x]) for x in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens in step")
        ax.set_ylabel("median step latency (ms)")
        ax.set_title(f"forwardkit bench: {self.trace} trace on {self.platform}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
