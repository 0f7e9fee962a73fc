"""Decode-shaped products (1-2 activation rows by default; ``--rows`` for batched decode) on
the CPU: the native few-row kernel against ``F.linear``, in bf16 and float32, interleaved in
one process. A row count a build does not serve prints "-" (the AVX2 build takes 1-16 rows in
bf16, every build 1-2 in float32).

Prints, per weight shape and row count, the median time and the weight bytes streamed per
second for each path, and which build of the native kernel ran ("avx512", "avx2").

Usage: ``python benchmarks/native_linear_gemv.py [--repeats 15] [--rounds 3] [--rows 1,2,4,16]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from forwardkit.kernels.cpu import native_linear

# Llama-3.2-1B's projections (qkv, o, gate_up, down) and a 32k slice of its LM head
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (32768, 2048)]


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    """Time the paths and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median taken)")
    parser.add_argument("--rows", default="1,2", help="comma-separated activation row counts")
    args = parser.parse_args(argv)
    row_counts = [int(r) for r in args.rows.split(",") if r.strip()]
    if not row_counts or min(row_counts) < 1:
        parser.error(f"--rows must be positive ints, got {args.rows!r}")
    torch.manual_seed(0)
    builds = {str(d).removeprefix("torch."): native_linear.kernel_isa(d)
              for d in (torch.bfloat16, torch.float32)}
    print(f"native builds: {builds}; {torch.get_num_threads()} threads")
    print(f"{'weight':>12} {'rows':>4} " + " ".join(f"{n:>24}" for n in
          ("native bf16", "F.linear bf16", "native f32", "F.linear f32")))
    for n, k in SHAPES:
        wb = torch.randn(n, k).to(torch.bfloat16)
        wf = wb.float()
        for rows in row_counts:
            xb = torch.randn(rows, k).to(torch.bfloat16)
            xf = xb.float()
            paths: dict[str, tuple[Callable[[], Any], int]] = {
                "native bf16": (lambda x=xb, w=wb: native_linear.linear_rows(x, w, None), 2),
                "F.linear bf16": (lambda x=xb, w=wb: F.linear(x, w), 2),
                "native f32": (lambda x=xf, w=wf: native_linear.linear_rows(x, w, None), 4),
                "F.linear f32": (lambda x=xf, w=wf: F.linear(x, w), 4),
            }
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, (fn, _size) in paths.items():
                    if name.startswith("native") and fn() is None:
                        continue  # no native build for this dtype here
                    times[name].append(_median_s(fn, args.repeats))
            cells = []
            for name, (_fn, size) in paths.items():
                if not times[name]:
                    cells.append(f"{'-':>24}")
                    continue
                t = statistics.median(times[name])
                cells.append(f"{t * 1e3:>9.2f} ms {n * k * size / t / 1e9:>6.1f} GB/s")
            print(f"{f'{n}x{k}':>12} {rows:>4} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
