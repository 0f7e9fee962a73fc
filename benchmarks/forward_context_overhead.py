"""Per-step CPU overhead of the forward context and of the CUDA-graph padding lookup.

Measures, in microseconds per step (median over repeats):

* ``set_forward_context`` enter + exit + one ``get_forward_context()`` with an engine config
  and a per-layer attention-metadata dict, telemetry off and on;
* the same as a data-parallel runner step does it: ``data_parallel_size=2`` (MoE), the agreed
  per-rank token counts passed in (``num_tokens_across_dp``), so entering builds ``DPMetadata``;
* the same with ``override_forward_context`` around a prebuilt context (the floor);
* the alternative a user would write by hand: a plain module global swapped by a
  ``@contextmanager`` generator (vLLM's pattern), for comparison;
* the padding lookup ``bs_to_padded_graph_size[n]`` (and ``pad_for_cudagraph(n)``).

Usage: ``python benchmarks/forward_context_overhead.py --iters 20000``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

import forwardkit.forward_context as fc
from forwardkit.config.compilation import CUDAGraphMode
from forwardkit.forward_context import (
    BatchDescriptor,
    create_forward_context,
    get_forward_context,
    override_forward_context,
    set_forward_context,
)
from forwardkit.platforms import use_platform


def capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default capture sizes: 1, 2, 4, then steps of 8 to 256, then 16 to 512."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


def padding_table(sizes: list[int]) -> list[int]:
    """``bs_to_padded_graph_size``: index n -> smallest capture size >= n."""
    table = [0] * (sizes[-1] + 1)
    it = iter(sizes)
    current = next(it)
    for n in range(1, len(table)):
        while current < n:
            current = next(it)
        table[n] = current
    return table


def make_config(num_layers: int, dp: int = 1) -> Any:
    """A real EngineConfig (``dp`` > 1: data parallel, rank 0, MoE), else a stand-in."""
    try:
        from forwardkit.config.engine import EngineConfig
        from forwardkit.config.parallel import ParallelConfig

        if dp > 1:
            cfg = EngineConfig(parallel_config=ParallelConfig(
                data_parallel_size=dp, data_parallel_rank=0, is_moe_model=True))
        else:
            cfg = EngineConfig()
    except Exception:  # pragma: no cover - only while the config layer is incomplete
        cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1),
                              compilation_config=SimpleNamespace(static_forward_context={}))
    layers = cfg.compilation_config.static_forward_context
    for i in range(num_layers):
        layers.setdefault(f"model.layers.{i}.self_attn.attn", object())
    return cfg


def time_per_step(step: Callable[[int], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call of ``step(i)`` over ``repeats`` timed loops."""
    per_loop = max(1, iters // repeats)
    samples = []
    for r in range(repeats + 1):
        t0 = time.perf_counter_ns()
        for i in range(per_loop):
            step(i)
        elapsed = time.perf_counter_ns() - t0
        if r:  # the first loop is a warm-up
            samples.append(elapsed / per_loop / 1000)
    return statistics.median(samples)


_GLOBAL_CTX: Any = None


@contextmanager
def _global_context(ctx: Any) -> Iterator[None]:
    """The hand-written alternative: one process global swapped by a generator."""
    global _GLOBAL_CTX
    prev, _GLOBAL_CTX = _GLOBAL_CTX, ctx
    try:
        yield
    finally:
        _GLOBAL_CTX = prev


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20000, help="steps per measurement")
    parser.add_argument("--repeats", type=int, default=21, help="timed loops per measurement")
    parser.add_argument("--layers", type=int, default=32, help="attention layers in the dict")
    parser.add_argument("--num-tokens", type=int, default=13)
    args = parser.parse_args(argv)
    if args.iters < args.repeats or args.repeats < 1:
        parser.error("--iters must be >= --repeats >= 1")

    with use_platform("cpu"):
        cfg = make_config(args.layers)
        attn = {name: SimpleNamespace(slot_mapping=None)
                for name in cfg.compilation_config.static_forward_context}
        n = args.num_tokens
        desc = BatchDescriptor(16)
        mode = CUDAGraphMode.PIECEWISE

        def fk_step(_: int) -> None:
            with set_forward_context(attn, cfg, num_tokens=n, cudagraph_runtime_mode=mode,
                                     batch_descriptor=desc):
                get_forward_context()

        dp_cfg = make_config(args.layers, dp=2)
        across_dp = torch.tensor([n, n + 3], dtype=torch.int32)  # what the planner hands in

        def fk_dp_step(_: int) -> None:
            with set_forward_context(attn, dp_cfg, num_tokens=n, num_tokens_across_dp=across_dp,
                                     cudagraph_runtime_mode=mode, batch_descriptor=desc):
                get_forward_context()

        prebuilt = create_forward_context(attn, cfg, cudagraph_runtime_mode=mode,
                                          batch_descriptor=desc)

        def override_step(_: int) -> None:
            with override_forward_context(prebuilt):
                get_forward_context()

        def global_step(_: int) -> None:
            with _global_context(prebuilt):
                _ = _GLOBAL_CTX

        table = padding_table(capture_sizes())
        sizes = [1 + (i * 37) % (len(table) - 1) for i in range(1024)]

        def pad_step(i: int) -> int:
            return table[sizes[i & 1023]]

        rows: list[tuple[str, str, float]] = []
        saved = (fc.track_batchsize, fc.batchsize_logging_interval)
        try:
            fc.track_batchsize = False
            rows.append(("set_forward_context + get", "off",
                         time_per_step(fk_step, args.iters, args.repeats)))
            rows.append(("set_forward_context(DP=2) + get", "off",
                         time_per_step(fk_dp_step, args.iters, args.repeats)))
            fc.track_batchsize, fc.batchsize_logging_interval = True, 1e12  # record, never log
            rows.append(("set_forward_context + get", "on",
                         time_per_step(fk_step, args.iters, args.repeats)))
        finally:
            fc.track_batchsize, fc.batchsize_logging_interval = saved
            fc.reset_batchsize_stats()
        rows.append(("override_forward_context + get", "-",
                     time_per_step(override_step, args.iters, args.repeats)))
        rows.append(("baseline: global + @contextmanager", "-",
                     time_per_step(global_step, args.iters, args.repeats)))
        rows.append(("bs_to_padded_graph_size[n]", "-",
                     time_per_step(pad_step, args.iters, args.repeats)))
        pad_fn = getattr(cfg, "pad_for_cudagraph", None)
        if pad_fn is not None and getattr(cfg.compilation_config, "bs_to_padded_graph_size", None):
            rows.append(("EngineConfig.pad_for_cudagraph(n)", "-",
                         time_per_step(lambda i: pad_fn(sizes[i & 1023]), args.iters,
                                       args.repeats)))

    print(f"forward-context overhead: {args.iters} steps x {args.repeats} loops, "
          f"{args.layers} attention layers, config {type(cfg).__name__}")
    print(f"{'operation':<38} {'telemetry':>9} {'median us/step':>15}")
    for name, telemetry_state, us in rows:
        print(f"{name:<38} {telemetry_state:>9} {us:>15.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
