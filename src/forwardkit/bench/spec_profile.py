"""Where a speculative decode step goes: ``forwardkit bench --generation --profile
--speculative-config JSON``.

Runs greedy generation on a speculating :class:`~forwardkit.engine.llm.LLM` and splits each of
its decode steps (every request past its prompt) into

* ``draft``: proposing the drafts (prompt lookup, or the draft model's catch-up and
  single-token steps);
* ``verify``: the target model's step over each request's last token and its drafts, with the
  LM head over the draft rows;
* ``sampling``: the sampler and the rejection sampling that accepts drafts (per-position target
  distributions, draws);
* ``host``: the rest of the engine step (scheduler, bookkeeping).

Wall-clock timers around the engine's own calls, no profiler: medians over the decode steps,
with the tokens each step emitted per request, so a step's cost can be read per token.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from forwardkit.engine.llm import LLM
    from forwardkit.engine.request import Request

__all__ = ["SPEC_PARTS", "SpecProfile", "format_spec_profiles", "profile_spec_steps"]

SPEC_PARTS = ("draft", "verify", "sampling", "host", "step")
"""The rows of a profile, in print order (``step`` is the whole engine step)."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclasses.dataclass
class SpecProfile:
    """Median milliseconds per decode step of each part, at one batch size."""

    batch_size: int
    steps: int
    ms: dict[str, float]
    tokens_per_request_step: float  # tokens a request emitted per decode step (mean)
    acceptance: float  # accepted / drafted over the profiled steps


class _Timers:
    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, part: str, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        def timed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] = self.spent.get(part, 0.0) + time.perf_counter() - start

        return timed


@contextmanager
def _instrumented(llm: LLM, timers: _Timers) -> Iterator[None]:
    """The engine's calls wrapped on their instances (the classes stay as they are)."""
    model = llm.runner.model
    targets = [(llm, "_propose_drafts", "draft"), (llm, "_execute", "verify"),
               (model, "compute_logits", "verify"), (llm.sampler, "sample", "sampling"),
               (llm.sampler, "target_distribution", "sampling"), (llm.sampler, "draw", "sampling")]
    try:
        for obj, name, part in targets:
            vars(obj)[name] = timers.wrap(part, getattr(obj, name))
        yield
    finally:
        for obj, name, _ in targets:
            vars(obj).pop(name, None)


def profile_spec_steps(llm: LLM, batch_size: int, prompt_len: int = 32, new_tokens: int = 32,
                       seed: int = 0) -> SpecProfile:
    """Time the decode steps of ``batch_size`` greedy requests of ``new_tokens`` tokens on a
    speculating ``llm`` (random prompts of ``prompt_len`` tokens)."""
    from forwardkit.engine.sampling_params import SamplingParams

    if llm.engine_config.speculative_config is None:
        raise ValueError("the speculative step profile needs an LLM with a speculative_config")
    if batch_size < 1 or prompt_len < 1 or new_tokens < 2:
        raise ValueError("batch_size and prompt_len must be >= 1, new_tokens >= 2")
    rng = random.Random(seed)
    vocab = int(llm.runner.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch_size)]
    timers = _Timers()
    samples: list[dict[str, float]] = []
    emitted: list[float] = []
    stats = llm.spec_stats
    drafted0, accepted0 = stats.num_draft_tokens, stats.num_accepted_tokens
    real_step = llm.step

    def step() -> list[Request]:
        waiting, running = llm.scheduler.waiting, llm.scheduler.running
        if waiting or not running or any(not r.output_token_ids for r in running):
            return real_step()  # a prefill step (or the first decode, still drafting nothing)
        before = {r.request_id: len(r.output_token_ids) for r in running}
        timers.spent.clear()
        start = time.perf_counter()
        out = real_step()
        total = time.perf_counter() - start
        parts = {p: timers.spent.get(p, 0.0) * 1e3 for p in ("draft", "verify", "sampling")}
        parts["step"] = total * 1e3
        parts["host"] = max(0.0, parts["step"] - sum(parts[p] for p in ("draft", "verify",
                                                                         "sampling")))
        samples.append(parts)
        emitted.append(statistics.mean(len(r.output_token_ids) - before[r.request_id]
                                       for r in list(running) + out if r.request_id in before))
        return out

    vars(llm)["step"] = step
    try:
        with _instrumented(llm, timers):
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        del vars(llm)["step"]
    if not samples:
        raise RuntimeError("no decode step was timed (new_tokens too small?)")
    drafted = stats.num_draft_tokens - drafted0
    accepted = stats.num_accepted_tokens - accepted0
    return SpecProfile(batch_size, len(samples),
                       {p: statistics.median(s[p] for s in samples) for p in SPEC_PARTS},
                       statistics.mean(emitted), accepted / drafted if drafted else 0.0)


def format_spec_profiles(profiles: list[SpecProfile], title: str) -> str:
    """One column per batch size: median ms per decode step of each part, tokens per step."""
    head = f"{'part (ms per decode step)':<28}" + "".join(
        f"{f'B={p.batch_size}':>12}" for p in profiles)
    lines = ["", title, "", head, "-" * len(head)]
    for part in SPEC_PARTS:
        lines.append(f"{part:<28}" + "".join(f"{p.ms[part]:>12.2f}" for p in profiles))
    lines.append(f"{'tokens per request per step':<28}"
                 + "".join(f"{p.tokens_per_request_step:>12.2f}" for p in profiles))
    lines.append(f"{'ms per token per request':<28}"
                 + "".join(f"{p.ms['step'] / p.tokens_per_request_step:>12.2f}" for p in profiles))
    lines.append(f"{'drafts accepted':<28}" + "".join(f"{p.acceptance:>12.0%}" for p in profiles))
    lines.append(f"{'decode steps timed':<28}" + "".join(f"{p.steps:>12d}" for p in profiles))
    return "\n".join(lines)
