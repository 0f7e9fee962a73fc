"""``forwardkit bench --workload``: traffic with shared prefixes, prefix caching on vs off.

Three workloads of the kind forwardkit's users run (``--quick`` shrinks each):

- ``rl``: an RL rollout: 16 prompts of 512 tokens, ``n=8`` samples each (temperature 1,
  seeded), 32 new tokens;
- ``chat``: 8 conversations of 4 turns; each turn resends the whole conversation (a
  256-token opening, then per turn the model's 32-token answer and a new 64-token message);
- ``system-prompt``: one 1,000-token system prompt followed by 32 different 24-token
  questions, 32 new tokens each.

One engine runs each workload with prefix caching on and off (``forwardkit`` and
``forwardkit-no-prefix-cache``: the block manager's caching switched between runs, so both
share the weights, the compiled pieces and the KV memory), the repeats alternating the order;
each run starts with an empty cache, so every hit comes from the workload's own sharing. Per contender:
prompt tokens, prompt tokens computed, hit rate, time to first token (median over requests;
for ``chat`` also the last turn's), wall time and output tokens per second, medians over the
repeats, and the on/off ratios.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forwardkit.engine.llm import LLM
    from forwardkit.engine.outputs import RequestOutput
    from forwardkit.engine.sampling_params import SamplingParams

__all__ = ["WORKLOADS", "WorkloadRun", "add_workload_args", "run_workload", "run_workloads"]

CONTENDERS = ("forwardkit", "forwardkit-no-prefix-cache")


@dataclass(frozen=True)
class Shape:
    """A workload's sizes."""

    prompts: int
    prompt_len: int
    new_tokens: int
    n: int = 1
    turns: int = 1
    turn_len: int = 0


# name -> (full shape, --quick shape, what it is)
WORKLOADS: dict[str, tuple[Shape, Shape, str]] = {
    "rl": (Shape(16, 512, 32, n=8), Shape(4, 64, 4, n=4),
           "RL rollout: prompts x n samples (temperature 1, seeded)"),
    "chat": (Shape(8, 256, 32, turns=4, turn_len=64), Shape(2, 48, 4, turns=3, turn_len=16),
             "multi-turn chat: each turn resends the conversation plus a new message"),
    "system-prompt": (Shape(32, 1000, 32, turn_len=24), Shape(8, 128, 4, turn_len=8),
                      "one long system prompt, different questions"),
}


@dataclass
class WorkloadRun:
    """One run of a workload on one engine."""

    prompt_tokens: int = 0
    computed_tokens: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    last_turn_ttft_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached / looked up."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _metric(llm: LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def _ttfts(outs: list[RequestOutput]) -> list[float]:
    return [t for o in outs if o.metrics is not None
            for t in [o.metrics.time_to_first_token] if t is not None]


def run_workload(llm: LLM, name: str, shape: Shape, seed: int) -> WorkloadRun:
    """Run workload ``name`` once on ``llm`` (its prefix cache reset first)."""
    from forwardkit.engine.sampling_params import SamplingParams

    vocab = int(llm.runner.vocab_size)
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(count)]

    greedy = SamplingParams(temperature=0.0, max_tokens=shape.new_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    before = {m: _metric(llm, m) for m in ("forwardkit:prompt_tokens_computed",
                                           "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
                                           "vllm:generation_tokens")}
    run = WorkloadRun()

    def generate(prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        run.prompt_tokens += sum(len(p) for p in prompts) * (
            params.n if not isinstance(params, list) else 1)
        run.ttft_s += _ttfts(outs)
        return outs

    start = time.perf_counter()
    if name == "rl":
        prompts = [tokens(shape.prompt_len) for _ in range(shape.prompts)]
        params = [SamplingParams(temperature=1.0, max_tokens=shape.new_tokens, ignore_eos=True,
                                 n=shape.n, seed=seed + i) for i in range(shape.prompts)]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        run.prompt_tokens = shape.prompts * shape.n * shape.prompt_len
        run.ttft_s = _ttfts(outs)
    elif name == "chat":
        conversations = [tokens(shape.prompt_len) for _ in range(shape.prompts)]
        for turn in range(shape.turns):
            outs = generate(conversations, greedy)
            if turn == shape.turns - 1:
                run.last_turn_ttft_s = _ttfts(outs)
            conversations = [c + list(o.outputs[0].token_ids) + tokens(shape.turn_len)
                             for c, o in zip(conversations, outs)]
    elif name == "system-prompt":
        system = tokens(shape.prompt_len)
        generate([system + tokens(shape.turn_len) for _ in range(shape.prompts)], greedy)
    else:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    run.wall_s = time.perf_counter() - start
    after = {m: _metric(llm, m) - before[m] for m in before}
    run.computed_tokens = int(after["forwardkit:prompt_tokens_computed"])
    run.hit_tokens = int(after["vllm:prefix_cache_hits"])
    run.query_tokens = int(after["vllm:prefix_cache_queries"])
    run.output_tokens = int(after["vllm:generation_tokens"])
    return run


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--workload`` to ``forwardkit bench``."""
    g = parser.add_argument_group("shared-prefix workloads (--workload)")
    g.add_argument("--workload", action="append", default=None, metavar="NAME",
                   choices=[*WORKLOADS, "all"],
                   help="run a shared-prefix workload end to end with prefix caching on and off "
                        f"side by side: {', '.join(WORKLOADS)} or all (repeatable); with "
                        "--quick, small versions")


def _shape(name: str, quick: bool) -> Shape:
    full, small, _ = WORKLOADS[name]
    return small if quick else full


def _longest(shape: Shape) -> int:
    if shape.turns > 1:
        return shape.prompt_len + (shape.turns - 1) * (shape.new_tokens + shape.turn_len) \
            + shape.new_tokens
    return shape.prompt_len + shape.turn_len + shape.new_tokens


def _build(args: argparse.Namespace, names: list[str], quick: bool) -> LLM:
    from forwardkit.commands.flag_config import engine_config_from_args
    from forwardkit.config.model_shapes import BUILTIN_MODEL_SHAPE, model_shape_config
    from forwardkit.engine.llm import LLM

    shapes = [_shape(n, quick) for n in names]
    ns = copy.copy(args)
    ns.enable_prefix_caching = True  # switched per run by run_workloads
    ns.max_model_len = ns.max_model_len or max(_longest(s) for s in shapes) + 1
    hf_config = None if args.model is not None else model_shape_config(
        args.model_shape or BUILTIN_MODEL_SHAPE)
    cfg = engine_config_from_args(ns, default_hf_config=hf_config)
    return LLM(engine_config=cfg, seed=args.seed)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _summary(runs: list[WorkloadRun]) -> dict[str, float]:
    return {
        "prompt_tokens": runs[0].prompt_tokens,
        "computed_tokens": _median([r.computed_tokens for r in runs]),
        "hit_rate": _median([r.hit_rate for r in runs]),
        "ttft_ms": _median([_median(r.ttft_s) for r in runs]) * 1e3,
        "last_turn_ttft_ms": _median([_median(r.last_turn_ttft_s) for r in runs]) * 1e3,
        "wall_s": _median([r.wall_s for r in runs]),
        "output_tok_s": _median([r.output_tokens / r.wall_s for r in runs]),
    }


def run_workloads(args: argparse.Namespace) -> int:
    """``forwardkit bench --workload ...``: build both engines, run in turns, print the table."""
    import torch
    from tqdm import tqdm

    names = list(WORKLOADS) if "all" in args.workload else list(dict.fromkeys(args.workload))
    quick = bool(args.quick)
    repeats = args.repeats or (1 if quick else 3)
    progress = not getattr(args, "no_progress", False)
    llm = _build(args, names, quick)
    for contender in tqdm(CONTENDERS, desc="warm-up", unit="mode", disable=not progress):
        llm.block_manager.set_prefix_caching(contender == "forwardkit")
        for name in names:  # untimed: compiles and first shapes
            run_workload(llm, name, dataclasses.replace(_shape(name, True), prompts=1), args.seed)
    runs: dict[tuple[str, str], list[WorkloadRun]] = {}
    total = len(names) * repeats * len(CONTENDERS)
    bar = tqdm(total=total, desc="timed workloads", unit="run", disable=not progress)
    for name in names:
        for r in range(repeats):
            order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
            for contender in order:
                llm.block_manager.set_prefix_caching(contender == "forwardkit")
                run = run_workload(llm, name, _shape(name, quick), args.seed + r)
                runs.setdefault((name, contender), []).append(run)
                bar.update(1)
    bar.close()
    mc = llm.runner.model_config
    dtype = str(llm.runner.dtype).removeprefix("torch.")
    report: dict[str, Any] = {
        "model": mc.model or (args.model_shape or "built-in") + " (random weights)",
        "dtype": dtype, "repeats": repeats, "threads": torch.get_num_threads(),
        "workloads": {name: {c: _summary(runs[(name, c)]) for c in CONTENDERS} for name in names},
    }
    print(format_report(report))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json_path}")
    llm.shutdown()
    return 0


def format_report(report: dict[str, Any]) -> str:
    """The table: one row per workload and contender, then the on/off ratios."""
    head = ("| workload | contender | prompt tokens | computed | hit rate | TTFT ms | "
            "last-turn TTFT ms | wall s | output tok/s |")
    lines = [f"forwardkit bench --workload: {report['model']} ({report['dtype']}), "
             f"median of {report['repeats']} runs per contender, {report['threads']} threads",
             "", head, "|" + " --- |" * 9]
    ratio_lines = []
    fmt: Callable[[float], str] = lambda v: "-" if v != v else f"{v:.1f}"  # noqa: E731
    for name, per in report["workloads"].items():
        for c, s in per.items():
            lines.append(f"| {name} | {c} | {s['prompt_tokens']} | {s['computed_tokens']:.0f} | "
                         f"{100 * s['hit_rate']:.1f}% | {fmt(s['ttft_ms'])} | "
                         f"{fmt(s['last_turn_ttft_ms'])} | {s['wall_s']:.2f} | "
                         f"{s['output_tok_s']:.1f} |")
        on, off = per["forwardkit"], per["forwardkit-no-prefix-cache"]
        parts = [f"computes {on['computed_tokens'] / max(off['computed_tokens'], 1):.3f}x the "
                 "prompt tokens",
                 f"throughput {on['output_tok_s'] / off['output_tok_s']:.2f}x",
                 f"TTFT {off['ttft_ms'] / on['ttft_ms']:.2f}x lower"]
        if on["last_turn_ttft_ms"] == on["last_turn_ttft_ms"]:
            parts.append(f"last-turn TTFT {off['last_turn_ttft_ms'] / on['last_turn_ttft_ms']:.2f}x "
                         "lower")
        ratio_lines.append(f"- {name}: caching on " + ", ".join(parts))
    return "\n".join(lines + ["", "prefix caching on vs off:"] + ratio_lines)
