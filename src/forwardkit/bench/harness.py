"""Runs a trace through every contender, interleaved step by step, and collects the figures."""

from __future__ import annotations

import argparse
import math
import platform as host
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from forwardkit import forward_context
from forwardkit.bench.contenders import Contender, build_contender
from forwardkit.bench.report import BenchReport, ContenderResult
from forwardkit.bench.trace import Step
from forwardkit.distributed.parallel_state import comm_wait_stats
from forwardkit.kernels.cpu import hugepages
from forwardkit.runner.batch import StepBatch

__all__ = ["blocks_for_trace", "make_batches", "run_bench"]


def blocks_for_trace(steps: list[Step], block_size: int) -> int:
    """KV blocks one runner needs so every step's requests get blocks of their own."""
    return max(
        sum(math.ceil((c + q) / block_size) for q, c in zip(s.query_lens, s.context_lens))
        for s in steps
    ) + 1


def make_batches(steps: list[Step], block_size: int, vocab_size: int, seed: int) -> list[StepBatch]:
    """One :class:`StepBatch` per step: random token ids, distinct blocks per request."""
    rng = random.Random(seed)
    batches = []
    for i, step in enumerate(steps):
        tables, next_block = [], 0
        for q, c in zip(step.query_lens, step.context_lens):
            n = math.ceil((c + q) / block_size)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        batches.append(StepBatch(
            req_ids=[f"s{i}r{j}" for j in range(step.num_reqs)],
            token_ids=[[rng.randrange(vocab_size) for _ in range(q)] for q in step.query_lens],
            num_computed_tokens=list(step.context_lens),
            block_tables=tables,
        ))
    return batches


@contextmanager
def _telemetry_into(store: defaultdict[int, list[float]]) -> Iterator[None]:
    """Record the forward context's batch-size timings of the block into ``store``."""
    saved = (forward_context.track_batchsize, forward_context.batchsize_logging_interval,
             forward_context.batchsize_forward_time)
    forward_context.track_batchsize = True
    if saved[1] < 0:
        forward_context.batchsize_logging_interval = math.inf  # record, don't log
    forward_context.batchsize_forward_time = store
    try:
        yield
    finally:
        (forward_context.track_batchsize, forward_context.batchsize_logging_interval,
         forward_context.batchsize_forward_time) = saved


def _timed_step(contender: Contender, batch: StepBatch) -> tuple[float, int, float]:
    """Run one step; (milliseconds, padded token count, milliseconds blocked on collectives)."""
    runner = contender.runner
    sync = runner.engine_config.platform.synchronize if runner.device.type != "cpu" else None
    waited = comm_wait_stats()["seconds"]
    start = time.perf_counter()
    runner.execute(batch)
    if sync is not None:
        sync()
    elapsed = (time.perf_counter() - start) * 1e3
    comm_ms = (comm_wait_stats()["seconds"] - waited) * 1e3
    last = runner.last_step
    padded = int(last.num_padded_tokens) if last is not None else batch.num_tokens
    return elapsed, padded, comm_ms


def run_bench(args: argparse.Namespace, names: list[str], steps: list[Step], *, trace_name: str,
              hf_config: dict[str, Any] | None, warmup_steps: int, seed: int = 0,
              progress: bool = True) -> BenchReport:
    """Build each contender, run ``warmup_steps`` untimed then every step timed, interleaved."""
    from tqdm import tqdm

    block_size = int(getattr(args, "block_size", None) or 16)
    num_blocks = blocks_for_trace(steps, block_size)
    contenders: dict[str, Contender] = {}
    results: dict[str, ContenderResult] = {}
    stores: dict[str, defaultdict[int, list[float]]] = {}  # token count -> step ms
    batches: list[StepBatch] = []
    for name in tqdm(names, desc="build + compile + first step", unit="contender", disable=not progress):
        contender = build_contender(name, args, hf_config, num_blocks)
        if not batches:
            vocab = contender.runner.vocab_size
            batches = make_batches(steps, block_size, vocab, seed)
        first_ms, _, _ = _timed_step(contender, batches[0])
        contenders[name] = contender
        results[name] = ContenderResult(name, startup_s=contender.build_s + first_ms / 1e3)
        stores[name] = defaultdict(list)
    traces_after_first = {name: c.traces() for name, c in contenders.items()}
    # the weights' move onto huge pages (started after a runner's first step) ends before
    # anything is timed: while it runs it takes a core and memory bandwidth
    hugepages.wait_for_moves(timeout=300)  # warns when time runs out

    order = list(contenders)
    warm = [batches[i % len(batches)] for i in range(warmup_steps)]
    for i, batch in enumerate(tqdm(warm + batches, desc="steps", unit="step", disable=not progress)):
        timed = i >= len(warm)
        rotated = order[i % len(order):] + order[: i % len(order)]  # no contender always first
        for name in rotated:
            if timed:
                with _telemetry_into(stores[name]):
                    ms, padded, comm_ms = _timed_step(contenders[name], batch)
                r = results[name]
                r.step_ms.append(ms)
                r.step_tokens.append(batch.num_tokens)
                r.padded_tokens.append(padded)
                last = contenders[name].runner.last_step
                r.step_modes.append(last.mode.name if last is not None else "NONE")
                r.comm_wait_ms.append(comm_ms)
                r.ubatched_steps += last is not None and last.ubatch_slices is not None
            else:
                _timed_step(contenders[name], batch)

    from forwardkit import telemetry

    for name, contender in contenders.items():
        # Forwardkit's counters are process-wide; only the forwardkit contender feeds them.
        results[name].recompiles = max(0, contender.traces() - traces_after_first[name])
    fk = contenders.get("forwardkit") or next(iter(contenders.values()))
    plat = fk.engine_config.platform
    return BenchReport(
        contenders=results,
        platform=plat.name,
        config_hash=fk.engine_config.compute_hash(),
        trace=trace_name,
        batchsize_stats={name: telemetry.summarize(store) for name, store in stores.items()},
        machine=_machine(),
    )


def _machine() -> str:
    """A one-line description of the host."""
    import os

    return (f"{host.machine()} {os.cpu_count()} cores, {host.system()}, Python "
            f"{host.python_version()}, torch {torch.__version__}")
