"""Decode speed of quantized weights side by side: bf16 against q8_0 and q4_0 (quantized on
load), one model shape, in one process, rounds interleaved.

For each weight format it builds ``LLM(model_shape=..., dtype="bfloat16", quantization=...)``
(seeded random weights; every engine with the same settings) and times greedy generation of
``--new-tokens`` tokens after an 8-token prompt at batch 1 and batch 16: decode time is the
time for 1 + N tokens minus the time for 1 (``bench.generation.time_generation``). Prints the
median decode tokens/s over ``--rounds`` rounds, the ratio to bf16, and the weight GB (all
weights, and the quantized projections alone).

Usage: ``python benchmarks/quantized_decode.py [--shape llama-3.2-1b] [--rounds 3]
[--new-tokens 16] [--formats bf16,q8_0,q4_0] [--eager] [--threads N]``
"""

from __future__ import annotations

import argparse
import statistics

import torch

from forwardkit.bench.generation import llm_generate, time_generation
from forwardkit.engine.llm import LLM
from forwardkit.kernels.cpu import native_quant
from forwardkit.layers.linear import Linear

BATCHES = (1, 16)


def _projection_bytes(llm: LLM) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for name, m in llm.runner.module.named_modules()
               if isinstance(m, Linear) and name.rpartition(".")[2] in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                        "down_proj"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--formats", default="bf16,q8_0,q4_0")
    parser.add_argument("--eager", action="store_true", help="enforce_eager for every engine")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for every engine (default: PyTorch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    gen = torch.Generator().manual_seed(0)
    prompts = {b: [[int(t) for t in torch.randint(0, 1000, (8,), generator=gen)] for _ in range(b)]
               for b in BATCHES}
    engines = {}
    for fmt in formats:
        engines[fmt] = LLM(model_shape=args.shape, dtype="bfloat16", max_num_seqs=max(BATCHES),
                           max_model_len=8 + args.new_tokens + 8, enforce_eager=args.eager,
                           quantization=None if fmt == "bf16" else fmt)
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for batch in BATCHES:
            for fmt, llm in engines.items():
                first, full = time_generation(llm_generate(llm), prompts[batch], args.new_tokens)
                rates.setdefault((fmt, batch), []).append(batch * args.new_tokens / (full - first))
    print(f"shape {args.shape}, {torch.get_num_threads()} threads, native quantized build "
          f"{native_quant.kernel_isa()} ({native_quant.DEFAULT_STRATEGY} strategy), "
          f"{'eager' if args.eager else 'compiled (default level)'}; median of {args.rounds} rounds")
    print(f"{'format':8} {'weights GB':>10} {'proj. GB':>9} " +
          " ".join(f"{'B=' + str(b) + ' tok/s':>12} {'x bf16':>6}" for b in BATCHES))
    for fmt, llm in engines.items():
        cells = []
        for batch in BATCHES:
            rate = statistics.median(rates[(fmt, batch)])
            base = statistics.median(rates[("bf16", batch)]) if "bf16" in engines else float("nan")
            cells.append(f"{rate:12.2f} {rate / base:6.2f}")
        print(f"{fmt:8} {llm.weight_bytes_per_rank()[0] / 1e9:10.3f} {_projection_bytes(llm) / 1e9:9.3f} "
              + " ".join(cells))


if __name__ == "__main__":
    main()
