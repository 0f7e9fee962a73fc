"""What LoRA costs a decode step, side by side in one process, the settings timed in alternation.

Three settings of one model shape (seeded random weights, the same in both engines):

* ``off``: ``enable_lora=False`` (no LoRA op in the model);
* ``on, none``: ``enable_lora=True`` (``max_loras=4``, ``max_lora_rank=16``), a step whose
  requests take no adapter;
* ``on, adapters``: the same engine, four rank-16 adapters on all seven projections (given as
  tensors through ``update_lora``, then put into the four slots); at batch 16 the requests take
  the four adapters in turn (four different adapters in the step), at batch 1 the one request
  takes one adapter (a one-request step holds one adapter; the four take turns over the rounds).

What is timed is the model step alone (``ModelRunner.execute``: the runner's per-step LoRA work,
the forward and the logits), a decode step of ``--batch`` requests at a context of
``--context`` tokens. Each round times every setting once, the order rotating from round to
round, so a background load weighs on all settings alike; the medians over ``--rounds`` rounds
(wall time, and the process's CPU time, which a loaded machine disturbs less at
``--threads 1``) and the cost of each setting relative to ``off`` are printed, per execution mode
(``--modes``: ``compiled``, the default optimisation level, and/or ``eager``). Then the median
time of ``update_lora`` for one such adapter.

Usage: ``python benchmarks/lora_decode.py [--shape llama-3.2-1b] [--modes compiled eager]
[--batches 1 16] [--rounds 15] [--context 128] [--dtype bfloat16] [--threads N]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from forwardkit.config.model_shapes import model_shape_config
from forwardkit.engine.llm import LLM
from forwardkit.engine.lora import LoRARequest
from forwardkit.kernels.cpu import hugepages
from forwardkit.runner.batch import StepBatch

RANK = 16
NUM_ADAPTERS = 4
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
SETTINGS = ("off", "on, none", "on, adapters")


def adapter_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """A random rank-16 adapter on all seven projections, in PEFT naming."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, parent in MODULES.items():
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.01
            out[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.01
    return out


def decode_batch(llm: LLM, batch: int, context: int, lora_slots: list[int] | None) -> StepBatch:
    """``batch`` requests decoding one token each after ``context`` tokens, each on its own
    KV blocks of ``llm``'s runner."""
    per_req = -(-(context + 1) // llm.runner.block_size)
    if batch * per_req > llm.runner.num_blocks:
        raise SystemExit(f"--batch {batch} x --context {context} needs {batch * per_req} KV "
                         f"blocks; the runner has {llm.runner.num_blocks}")
    return StepBatch(req_ids=[f"r{i}" for i in range(batch)], token_ids=[[7 + i] for i in range(batch)],
                     num_computed_tokens=[context] * batch,
                     block_tables=[list(range(i * per_req, (i + 1) * per_req)) for i in range(batch)],
                     lora_slots=lora_slots)


def time_steps(steps: dict[str, tuple[LLM, list[StepBatch]]],
               rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process CPU seconds of each setting's step per round, the settings in rotating
    order; a setting with several batches (the adapters taking turns) runs the next one each
    round."""
    names = list(steps)
    for _ in range(3):  # first uses of a row count compile / pack weights: untimed
        for name in names:
            llm, batches = steps[name]
            for b in batches:
                llm.runner.execute(b)
    hugepages.wait_for_moves(timeout=300)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            llm, batches = steps[name]
            b = batches[r % len(batches)]
            start, start_cpu = time.perf_counter(), time.process_time()
            llm.runner.execute(b)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def run_mode(args: argparse.Namespace, cfg: dict, eager: bool) -> None:
    """Build the two engines in ``eager`` or compiled mode, time the settings, print them."""
    common = dict(model_shape=args.shape, dtype=args.dtype, max_num_seqs=max(args.batches),
                  max_model_len=args.context + 16, enforce_eager=eager,
                  enable_prefix_caching=False)
    off = LLM(**common)
    on = LLM(**common, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    assert on.lora is not None
    adapters: list[LoRARequest] = []
    update_s: list[float] = []
    hugepages.wait_for_moves(timeout=300)  # a compiled engine's start-up steps started the move
    for i in range(NUM_ADAPTERS):
        tensors = adapter_tensors(cfg, i)
        start = time.perf_counter()
        adapters.append(on.update_lora(f"a{i}", tensors, config={"lora_alpha": 32}))
        update_s.append(time.perf_counter() - start)
    for i in range(NUM_ADAPTERS):  # an update of an adapter that is already registered (RL)
        tensors = adapter_tensors(cfg, 10 + i)
        start = time.perf_counter()
        on.update_lora(f"a{i}", tensors)
        update_s.append(time.perf_counter() - start)
    slots = on.lora.activate([a.lora_int_id for a in adapters])
    label = "eager" if eager else "compiled (default level)"
    medians: dict[tuple[str, int], float] = {}
    cpu_medians: dict[tuple[str, int], float] = {}
    for batch in args.batches:
        mixed = [slots[i % NUM_ADAPTERS] for i in range(batch)]
        if batch == 1:  # one request holds one adapter: the four take turns over the rounds
            with_adapters = [decode_batch(on, 1, args.context, [s]) for s in slots]
        else:
            with_adapters = [decode_batch(on, batch, args.context, mixed)]
        steps = {"off": (off, [decode_batch(off, batch, args.context, None)]),
                 "on, none": (on, [decode_batch(on, batch, args.context, [-1] * batch)]),
                 "on, adapters": (on, with_adapters)}
        wall, cpu = time_steps(steps, args.rounds)
        for name in wall:
            medians[(name, batch)] = statistics.median(wall[name]) * 1e3
            cpu_medians[(name, batch)] = statistics.median(cpu[name]) * 1e3
    print(f"\n{label}, {torch.get_num_threads()} threads: decode step at context {args.context}, "
          f"median ms of {args.rounds} rounds, wall and process CPU time (x off: the step's cost "
          "relative to LoRA off)")
    print(f"{'setting':14} " + " ".join(f"{'B=' + str(b) + ' ms':>10} {'x off':>6} {'cpu ms':>8} "
                                        f"{'x off':>6}" for b in args.batches))
    for name in SETTINGS:
        cells = [f"{medians[(name, b)]:10.2f} {medians[(name, b)] / medians[('off', b)]:6.2f} "
                 f"{cpu_medians[(name, b)]:8.2f} "
                 f"{cpu_medians[(name, b)] / cpu_medians[('off', b)]:6.2f}" for b in args.batches]
        print(f"{name:14} " + " ".join(cells))
    print(f"update_lora of one adapter from tensors: median {statistics.median(update_s) * 1e3:.1f} "
          f"ms (min {min(update_s) * 1e3:.1f}, max {max(update_s) * 1e3:.1f}; {len(update_s)} calls)"
          f"; load at end {_load()}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--modes", nargs="+", choices=("compiled", "eager"),
                        default=["compiled", "eager"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: PyTorch's choice, the cores)")
    args = parser.parse_args()
    if min(args.batches) < 1 or args.rounds < 1 or args.context < 1:
        parser.error("--batches, --rounds and --context take positive integers")
    if len(args.modes) > 1:  # one process per mode: a compiled engine's memory is not freed
        for mode in args.modes:
            subprocess.run([sys.executable, __file__, "--shape", args.shape, "--modes", mode,
                            "--batches", *map(str, args.batches), "--rounds", str(args.rounds),
                            "--context", str(args.context), "--dtype", args.dtype,
                            *(["--threads", str(args.threads)] if args.threads else [])],
                           check=True)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_shape_config(args.shape)
    print(f"shape {args.shape}, {args.dtype}, {torch.get_num_threads()} threads; rank {RANK} on "
          f"all seven projections, {NUM_ADAPTERS} adapters; load at start {_load()}")
    run_mode(args, cfg, args.modes[0] == "eager")


if __name__ == "__main__":
    main()
