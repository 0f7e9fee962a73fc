"""Prompt (prefill) speed of quantized weights side by side: the projections of one layer of a
model shape (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) multiplied by a
``--tokens``-row bf16 activation, in bf16 and in q8_0 / q4_0 / q4_1, in one process, rounds
interleaved.

Each format is timed as a model calls it: bf16 through the ``forwardkit::linear`` op with a CPU
linear router bound (the native kernels, oneDNN's packed or plain matmul, or on a CPU without
native bf16 the AVX2 blocked kernel), the quantized formats through ``forwardkit::quant_linear``
(the tiled native kernel past 16 rows). ``--before`` also times each quantized format the way
the op served prompts before the tiled kernel: the weight dequantized (natively), then
``F.linear`` in bf16. Prints the median time of the layer's products over ``--rounds`` rounds,
the prompt tokens/s that gives for all the shape's layers (projections only: no attention,
norms or LM head), and the ratio to bf16.

``--isa`` forces one native quantized build (e.g. ``avx2`` on an AVX-512 machine); run the
script under ``ONEDNN_MAX_CPU_ISA=AVX2`` to see oneDNN (and so the bf16 router) as on a CPU
without native bf16 arithmetic.

Usage: ``python benchmarks/quantized_prefill.py [--shape llama-3.2-1b] [--tokens 64]
[--rounds 7] [--formats bf16,q8_0,q4_0,q4_1] [--before] [--isa avx2] [--threads N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from forwardkit.config.model_shapes import model_shape_config
from forwardkit.kernels.cpu import native_linear, native_quant
from forwardkit.kernels.cpu.router import CpuLinearRouter, bind, prepack_supported
from forwardkit.quantization import ops as _ops  # noqa: F401  (registers forwardkit::quant_linear)
from forwardkit.quantization.formats import quantize


def _layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    cfg = model_shape_config(shape)
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return {"qkv_proj": ((heads + 2 * kv) * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--formats", default="bf16,q8_0,q4_0,q4_1")
    parser.add_argument("--before", action="store_true",
                        help="also time dequantize + bf16 F.linear (the op's former prompt path)")
    parser.add_argument("--isa", default=None, help="force one native quantized build")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    layers = int(model_shape_config(args.shape)["num_hidden_layers"])
    shapes = _layer_shapes(args.shape)
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
               for name, (n, k) in shapes.items()}
    xs = {k: torch.randn(args.tokens, k, generator=gen).to(torch.bfloat16) for _, k in shapes.values()}
    router = CpuLinearRouter(timing=False)
    router.route_weights((w, None) for w in weights.values())

    def bf16_layer() -> None:
        with bind(router):
            for w in weights.values():
                torch.ops.forwardkit.linear(xs[w.shape[1]], w, None)

    candidates: dict[str, Callable[[], None]] = {}
    for fmt in args.formats.split(","):
        if fmt == "bf16":
            candidates[fmt] = bf16_layer
            continue
        packed = {name: quantize(w, fmt) for name, w in weights.items()}

        def q_layer(packed: dict[str, torch.Tensor] = packed, fmt: str = fmt) -> None:
            for name, p in packed.items():
                x = xs[weights[name].shape[1]]
                if args.isa is None:
                    torch.ops.forwardkit.quant_linear(x, p, None, fmt)
                elif native_quant.quant_linear_rows(x, p, None, fmt, isa=args.isa) is None:
                    raise SystemExit(f"build {args.isa!r} is not usable here")

        def before(packed: dict[str, torch.Tensor] = packed, fmt: str = fmt) -> None:
            for name, p in packed.items():
                w = native_quant.dequantize_rows(p, fmt)
                assert w is not None
                F.linear(xs[weights[name].shape[1]], w.to(torch.bfloat16))

        candidates[fmt] = q_layer
        if args.before:
            candidates[f"{fmt} before"] = before
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():  # warm-up: builds, packed copies
        fn()
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"shape {args.shape} ({layers} layers), {args.tokens}-token prompt, "
          f"{torch.get_num_threads()} threads; quantized build {args.isa or native_quant.kernel_isa()}, "
          f"bf16: {'oneDNN native bf16' if prepack_supported(torch.bfloat16) else 'no native bf16'}"
          f" (native bf16 prompt kernel {'on' if native_linear.bf16_rows_available() else 'off'}); "
          f"median of {args.rounds} rounds")
    base = statistics.median(times["bf16"]) if "bf16" in times else float("nan")
    print(f"{'format':14} {'layer ms':>9} {'prompt tok/s':>13} {'x bf16':>7}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:14} {t * 1e3:9.2f} {args.tokens / (t * layers):13.1f} {base / t:7.2f}")


if __name__ == "__main__":
    main()
