"""Engine metrics as ``LLM.get_metrics()`` returns them (the shapes of vLLM's metrics reader).

Each metric has a ``name`` (vLLM's ``vllm:`` names where vLLM reports the same quantity,
``forwardkit:`` for figures vLLM does not have), ``labels`` and a value: a :class:`Counter`
only grows over the engine's life, a :class:`Gauge` is a current level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from forwardkit.engine.block_manager import BlockManager
from forwardkit.engine.request import Request
from forwardkit.engine.speculative import SpecDecodeStats

__all__ = ["Counter", "EngineStats", "Gauge", "Metric", "Vector"]


@dataclass
class Metric:
    """A named metric with labels and its value."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = 0


@dataclass
class Counter(Metric):
    """A monotonically growing count (an integer)."""


@dataclass
class Gauge(Metric):
    """A level at the time of the call."""


@dataclass
class Vector(Metric):
    """A list of counts (``value`` is their sum)."""

    values: list[int] = field(default_factory=list)


@dataclass
class EngineStats:
    """What the engine counts per step (the block manager counts the prefix-cache lookups).

    ``prompt_tokens_computed`` are prompt positions actually run through the model (cache hits
    excluded, recomputation after a preemption included); ``prompt_tokens`` are the prompt
    tokens of the requests admitted, ``generation_tokens`` the tokens sampled.
    """

    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)

    def record_step(self, requests: list[Request], num_scheduled: list[int],
                    num_preempted: int, num_sampled: int) -> None:
        """Count one step's work."""
        for req, n in zip(requests, num_scheduled):
            start = req.num_computed_tokens
            self.prompt_tokens_computed += max(0, min(start + n, req.num_prompt_tokens) - start)
        self.num_preemptions += num_preempted
        self.generation_tokens += num_sampled

    def record_added(self, requests: list[Request]) -> None:
        """Count the prompt tokens of newly queued requests."""
        self.prompt_tokens += sum(r.num_prompt_tokens for r in requests)

    def record_finished(self, requests: list[Request]) -> None:
        """Count finished requests by finish reason."""
        for req in requests:
            reason = req.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def metrics(self, blocks: BlockManager, num_running: int, num_waiting: int,
                spec: SpecDecodeStats | None = None,
                kernel_calls: dict[str, int] | None = None) -> list[Metric]:
        """Every metric, in a fixed order (the spec-decode ones when ``spec`` is given; the
        native CPU kernels' served calls, this process's, when ``kernel_calls`` is)."""
        cache = blocks.stats
        used = blocks.num_blocks - blocks.num_free_blocks
        out: list[Metric] = [
            Counter("vllm:prefix_cache_queries", value=cache.queries),
            Counter("vllm:prefix_cache_hits", value=cache.hits),
            Counter("vllm:prompt_tokens", value=self.prompt_tokens),
            Counter("vllm:generation_tokens", value=self.generation_tokens),
            Counter("vllm:num_preemptions", value=self.num_preemptions),
            Counter("forwardkit:prompt_tokens_computed", value=self.prompt_tokens_computed),
            Counter("forwardkit:prefix_cache_preempted_queries", value=cache.preempted_queries),
            Counter("forwardkit:prefix_cache_preempted_hits", value=cache.preempted_hits),
            Gauge("vllm:num_requests_running", value=float(num_running)),
            Gauge("vllm:num_requests_waiting", value=float(num_waiting)),
            Gauge("vllm:kv_cache_usage_perc", value=used / blocks.num_blocks),
            Gauge("forwardkit:prefix_cache_hit_rate", value=cache.hit_rate),
        ]
        if spec is not None:
            out += [
                Counter("vllm:spec_decode_num_drafts", value=spec.num_drafts),
                Counter("vllm:spec_decode_num_draft_tokens", value=spec.num_draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", value=spec.num_accepted_tokens),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos",
                       value=sum(spec.accepted_per_pos), values=list(spec.accepted_per_pos)),
                Gauge("forwardkit:spec_decode_mean_accepted_length",
                      value=spec.mean_accepted_length),
            ]
        for kernel, calls in sorted((kernel_calls or {}).items()):
            out.append(Counter("forwardkit:native_kernel_calls", {"kernel": kernel}, calls))
        for reason in sorted(self.finished):
            out.append(Counter("vllm:request_success", {"finished_reason": reason},
                               self.finished[reason]))
        return out
