"""What loading a GGUF file's Q4_K and Q6_K tensors rounds: the error of the repack against the
``gguf`` package's (ggml's) dequantization, on random valid blocks of a ``rows x k`` matrix.

Q4_K becomes ``q4_1`` (the sub-block scale and offset products rounded to fp16), Q6_K becomes
``q8_0`` (requantized with ggml's q8_0 reference rounding). Prints, per type, the largest error,
the largest and mean error relative to the largest magnitude of the weight's 32-weight block,
and the share of weights that come out exactly.

Usage: ``python benchmarks/gguf_repack_error.py [--rows 2048] [--k 2048] [--seed 0]``
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from forwardkit.quantization import gguf_types
from forwardkit.quantization.formats import dequantize


def random_blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random valid Q4_K / Q6_K bytes with small finite fp16 super-block scales."""
    size, offsets = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[kind]
    rng = np.random.default_rng(seed)
    n = rows * k // 256
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in offsets:
        blocks[:, off:off + 2] = rng.uniform(0.0005, 0.004, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def main() -> None:
    import gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| GGUF type | held as | max error | max error / block max | mean error / block max "
          "| weights exact |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind, fmt in (("Q4_K", "q4_1"), ("Q6_K", "q8_0")):
        raw = random_blocks(kind, args.rows, args.k, args.seed)
        exact = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))
        packed = gguf_types.packed_values(torch.from_numpy(raw), kind, args.rows)
        err = (dequantize(packed, fmt) - exact).abs().reshape(-1, 32)
        block_max = exact.reshape(-1, 32).abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        rel = err / block_max
        print(f"| {kind} | {fmt} | {err.max():.3g} | {rel.max() * 100:.3f} % | "
              f"{rel.mean() * 100:.4f} % | {(err == 0).float().mean() * 100:.1f} % |")


if __name__ == "__main__":
    main()
