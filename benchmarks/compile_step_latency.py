"""Step latency of the built-in default model: eager vs stock torch.compile vs forwardkit modes 2/3.

All four run side by side in one process over the same trace of steps (decode batches of 1-64
requests and prefill chunks up to 512 tokens), with attention metadata built the way the runner
builds it. Each variant is warmed up on every distinct step size first (so compile time is not in
the figures), then the trace is replayed ``--repeats`` times. Printed: median step latency per
variant (all steps, decode steps, prefill steps) as a ratio to eager, and how many times each
variant recompiled (traced the model again).

    python benchmarks/compile_step_latency.py [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.engine import EngineConfig
from forwardkit.config.model import ModelConfig
from forwardkit.forward_context import set_forward_context
from forwardkit.kernels.cpu.router import attached_router, bind
from forwardkit.layers.attention import build_attention_metadata
from forwardkit.layers.kv_cache import bind_kv_cache
from forwardkit.models.default import default_hf_config
from forwardkit.models.loader import load_model

BLOCK = 16
CONTEXT = 40  # tokens already in the cache of each decoding request


def make_trace(seed: int = 0) -> list[tuple[str, int]]:
    """("decode", batch) for batches of 1-64 and ("prefill", tokens) for chunks up to 512."""
    rng = random.Random(seed)
    steps = [("decode", b) for b in (1, 2, 3, 5, 8, 13, 16, 24, 31, 32, 47, 64)]
    steps += [("prefill", n) for n in (17, 64, 100, 128, 250, 384, 512)]
    steps += [("decode", rng.randint(1, 64)) for _ in range(12)]
    rng.shuffle(steps)
    return steps


class Variant:
    """One model instance + its KV cache; ``step(kind, n)`` runs one forward."""

    def __init__(self, name: str, mode: int, stock: bool = False, native: bool = False) -> None:
        self.name = name
        # the baselines run every op native (no custom-op wrappers, plain F.linear: "-cpu_linear",
        # attention by torch ops: "-cpu_attention"), as a user's model does
        extra = {"custom_ops": ["none", "-cpu_linear", "-cpu_attention"]} if native else {}
        self.cfg = EngineConfig(model_config=ModelConfig(hf_config=default_hf_config()),
                                compilation_config={"mode": mode, "backend": "inductor", **extra})
        self.model = load_model(self.cfg)
        self.router = attached_router(self.model)  # None for the baselines
        self.ctx = self.cfg.compilation_config.static_forward_context
        self.caches = bind_kv_cache(self.ctx, 64 * 4 + 40, BLOCK, torch.float32, "cpu")
        self.traces = 0
        self.fn: Callable[..., Any] = self.model
        if stock:
            from torch._inductor.compile_fx import compile_fx

            def counting(gm: Any, example_inputs: Any) -> Any:
                self.traces += 1
                return compile_fx(gm, example_inputs)

            self.fn = torch.compile(self.model, backend=counting, dynamic=True)

    def inputs(self, kind: str, n: int) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
        if kind == "decode":
            per = -(-(CONTEXT + 1) // BLOCK)
            md = build_attention_metadata([1] * n, [CONTEXT + 1] * n,
                                          [list(range(i * per, (i + 1) * per)) for i in range(n)],
                                          n, BLOCK, "cpu")
            positions = torch.full((n,), CONTEXT)
        else:
            md = build_attention_metadata([n], [n], [list(range(-(-n // BLOCK)))], n, BLOCK, "cpu")
            positions = torch.arange(n)
        ids = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(n))
        return md, ids, positions, n

    def step(self, kind: str, n: int) -> float:
        md, ids, pos, tokens = self.inputs(kind, n)
        with torch.no_grad(), bind(self.router), \
                set_forward_context({k: md for k in self.ctx}, self.cfg, num_tokens=tokens):
            t0 = time.perf_counter()
            self.fn(ids, pos)
            return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trace = make_trace()
    variants = [
        Variant("eager", 0, native=True),
        Variant("torch.compile(dynamic=True)", 0, stock=True, native=True),
        Variant("forwardkit mode 2", 2),
        Variant("forwardkit mode 3", 3),
    ]
    for v in variants:  # warm-up: compile everything the trace needs (largest first)
        before = compilation_counter.clone()
        t0 = time.perf_counter()
        for kind, n in sorted(set(trace), key=lambda s: -s[1]):
            v.step(kind, n)
        v.warmup_s = time.perf_counter() - t0
        if not v.name.startswith("torch.compile"):
            v.traces = compilation_counter.num_dynamo_traces - before.num_dynamo_traces
        v.times = {"all": [], "decode": [], "prefill": []}
    for _ in range(args.repeats):
        for kind, n in trace:
            for v in variants:  # interleaved so background load hits all variants alike
                dt = v.step(kind, n)
                v.times["all"].append(dt)
                v.times[kind].append(dt)
    base = {k: statistics.median(variants[0].times[k]) for k in ("all", "decode", "prefill")}
    print(f"trace: {len(trace)} steps x {args.repeats} repeats; torch threads {torch.get_num_threads()}")
    print(f"{'variant':30s} {'median ms':>10s} {'ratio':>6s} {'decode':>7s} {'prefill':>8s} "
          f"{'recompiles':>10s} {'warm-up s':>9s}")
    for v in variants:
        med = {k: statistics.median(v.times[k]) for k in base}
        recompiles = max(v.traces - 1, 0) if v.traces else 0
        print(f"{v.name:30s} {med['all'] * 1e3:10.2f} {med['all'] / base['all']:6.2f} "
              f"{med['decode'] / base['decode']:7.2f} {med['prefill'] / base['prefill']:8.2f} "
              f"{recompiles:10d} {v.warmup_s:9.1f}")
    print("ratios are median latency / eager median (lower is faster); recompiles = traces - 1")


if __name__ == "__main__":
    main()
