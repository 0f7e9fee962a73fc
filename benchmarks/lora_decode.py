"""What LoRA costs a decode step, side by side in one process, rounds interleaved.

Three settings of one model shape (seeded random weights, the same in every engine):

* ``off``: ``enable_lora=False`` (no LoRA op in the model);
* ``on, none``: ``enable_lora=True`` (``max_loras=4``, ``max_lora_rank=16``), requests without
  an adapter (the op returns at once);
* ``on, 4 adapters``: the same engine, requests taking four rank-16 adapters on all seven
  projections in turn (given as tensors through ``update_lora``).

Greedy generation of ``--new-tokens`` tokens after an 8-token prompt at batch 1 and 16; decode
time is the time for 1 + N tokens minus the time for 1 (``bench.generation.time_generation``).
Prints the median decode tokens/s over ``--rounds`` rounds and the ratio to ``off``, then the
median time of ``update_lora`` for one such adapter.

Usage: ``python benchmarks/lora_decode.py [--shape default|llama-3.2-1b] [--rounds 3]
[--new-tokens 16] [--eager] [--dtype bfloat16]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from forwardkit.bench.generation import llm_generate, time_generation
from forwardkit.config.model_shapes import model_shape_config
from forwardkit.engine.llm import LLM
from forwardkit.engine.lora import LoRARequest

BATCHES = (1, 16)
RANK = 16
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true", help="enforce_eager for every engine")
    args = parser.parse_args()
    cfg = model_shape_config(args.shape)
    gen = torch.Generator().manual_seed(0)
    prompts = {b: [[int(t) for t in torch.randint(0, 1000, (8,), generator=gen)] for _ in range(b)]
               for b in BATCHES}
    common = dict(model_shape=args.shape, dtype=args.dtype, max_num_seqs=max(BATCHES),
                  max_model_len=8 + args.new_tokens + 8, enforce_eager=args.eager,
                  enable_prefix_caching=False)
    off = LLM(**common)
    on = LLM(**common, enable_lora=True, max_loras=4, max_lora_rank=RANK)
    adapters: list[LoRARequest] = []
    update_s = []
    for i in range(4):
        tensors = adapter_tensors(cfg, i)
        start = time.perf_counter()
        adapters.append(on.update_lora(f"a{i}", tensors, config={"lora_alpha": 32}))
        update_s.append(time.perf_counter() - start)
    for i in range(4):  # an update of an adapter that is already registered (the RL case)
        tensors = adapter_tensors(cfg, 10 + i)
        start = time.perf_counter()
        on.update_lora("a0", tensors)
        update_s.append(time.perf_counter() - start)
    settings = {"off": (off, ()), "on, none": (on, ()), "on, 4 adapters": (on, adapters)}
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in BATCHES:
            for name, (llm, loras) in settings.items():
                first, full = time_generation(llm_generate(llm, loras), prompts[batch],
                                              args.new_tokens)
                rates.setdefault((name, batch), []).append(batch * args.new_tokens / (full - first))
    print(f"shape {args.shape}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"{'eager' if args.eager else 'compiled (default level)'}; rank {RANK} on all seven "
          f"projections; median of {args.rounds} rounds")
    print(f"{'setting':16} " + " ".join(f"{'B=' + str(b) + ' tok/s':>12} {'x off':>6}"
                                        for b in BATCHES))
    for name in settings:
        cells = []
        for batch in BATCHES:
            rate = statistics.median(rates[(name, batch)])
            base = statistics.median(rates[("off", batch)])
            cells.append(f"{rate:12.2f} {rate / base:6.2f}")
        print(f"{name:16} " + " ".join(cells))
    print(f"update_lora of one adapter from tensors: median {statistics.median(update_s) * 1e3:.1f} "
          f"ms (min {min(update_s) * 1e3:.1f}, max {max(update_s) * 1e3:.1f}; {len(update_s)} calls)")


if __name__ == "__main__":
    main()
