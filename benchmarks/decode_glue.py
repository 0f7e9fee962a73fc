"""What a decode step spends outside its linear products, and why: the glue on cold caches.

A decode step of the 1B shape runs 65 native linear products (4 per layer and the LM head) and,
between them, the Python and PyTorch glue: the Inductor wrapper's kernels, allocations and
size checks, the ``forwardkit::linear`` and attention ops' dispatch, the sampler and the
engine's bookkeeping. This script times a model step (``ModelRunner.execute``, the forward and
the logits) of ``--batch`` requests at ``--context`` tokens, in three settings of the native
linear function (the one ``native_linear.linear_rows`` calls), timed in alternation, the order
rotating from round to round so a drifting host weighs on all of them alike:

* ``kernel``: the native kernel, as the engine runs it;
* ``no-op``: a function that returns at once (the outputs are stale; the step computes nothing
  but its glue, on caches that nothing has flushed);
* ``memmove``: a function that copies the weight's bytes into a scratch buffer and computes
  nothing: the caches see the same stream of weights as with the kernel.

For each: the median step, the median time inside the linear function over a step, the
rest (step minus linear: the glue and the attention) and the products the function served in
a step (the same in every setting, or the substitution missed some). If the glue costs more after a real or
a copied stream of weights than with ``no-op``, it is running on caches the weights have just
evicted. Tokens are not checked (two of the settings compute nothing).

Usage: ``python benchmarks/decode_glue.py [--shape llama-3.2-1b] [--batches 1 16]
[--context 64] [--rounds 8]`` (bf16 weights); set ``FORWARDKIT_CPU_MAX_ISA=avx2`` to time
the AVX2 build on a CPU with AVX-512.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from forwardkit.bench.harness import make_batches
from forwardkit.bench.trace import Step
from forwardkit.config.model_shapes import model_shape_names
from forwardkit.engine.llm import LLM
from forwardkit.kernels.cpu import hugepages, native_linear
from forwardkit.runner.batch import StepBatch

SETTINGS = ("kernel", "no-op", "memmove")
_SCRATCH_BYTES = 64 << 20


def decode_batch(llm: LLM, batch: int, context: int) -> StepBatch:
    """``batch`` requests decoding one token each after ``context`` tokens, on their own blocks."""
    step = Step(query_lens=(1,) * batch, context_lens=(context,) * batch)
    made = make_batches([step], llm.runner.block_size, int(llm.runner.vocab_size), seed=0)[0]
    need = made.block_tables[-1][-1] + 1
    if need > llm.runner.num_blocks:
        raise SystemExit(f"--batches {batch} x --context {context} needs {need} KV blocks; the "
                         f"runner has {llm.runner.num_blocks}")
    return made


def linear_functions(kernel: Callable[..., int],
                     scratch: torch.Tensor) -> dict[str, Callable[..., int]]:
    """The three settings' linear functions (the ``fk_linear_*`` signature: x, w, bias, y, M, N,
    K as addresses and longs; 0 for success): ``kernel`` and its two stand-ins."""
    dst, room = scratch.data_ptr(), scratch.numel()

    def noop(x: int, w: int, bias: int | None, y: int, m: int, n: int, k: int) -> int:
        return 0

    def copy(x: int, w: int, bias: int | None, y: int, m: int, n: int, k: int) -> int:
        left, src = n * k * 2, w
        while left > 0:
            step = min(left, room)
            ctypes.memmove(dst, src, step)
            left, src = left - step, src + step
        return 0

    return {"kernel": kernel, "no-op": noop, "memmove": copy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=model_shape_names())
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    for flag, values in (("--batches", args.batches), ("--context", [args.context]),
                         ("--rounds", [args.rounds])):
        if min(values) < 1:
            parser.error(f"{flag} must be >= 1, got {' '.join(map(str, values))}")

    llm = LLM(model_shape=args.shape, dtype="bfloat16", max_num_seqs=max(args.batches),
              max_model_len=args.context + 16, enable_prefix_caching=False)
    found = native_linear._selected(torch.bfloat16)
    if found is None:
        raise SystemExit("no native bf16 linear kernel on this machine (see `forwardkit env`)")
    scratch = torch.empty(_SCRATCH_BYTES, dtype=torch.uint8)
    scratch.fill_(0)
    fns = linear_functions(found[1], scratch)
    inside = [0.0]
    calls = [0]
    current: list[Callable[..., int]] = [fns["kernel"]]

    def timed(*a: object) -> int:
        start = time.perf_counter()
        rc = current[0](*a)
        inside[0] += time.perf_counter() - start
        calls[0] += 1
        return int(rc)

    # linear_rows looks the function up on every call: every product of the step goes here
    native_linear._selected = lambda dtype: (found[0], timed, found[2])  # type: ignore[assignment]
    print(f"{args.shape} (bfloat16), native linear build {found[0]}, decode steps at "
          f"{args.context} tokens of context, median of {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'setting':<8} {'step ms':>8} {'in linear ms':>13} {'rest ms':>8} "
          f"{'products':>8}")
    for b in args.batches:
        batch = decode_batch(llm, b, args.context)
        for _ in range(3):  # first uses of a row count: untimed
            llm.runner.execute(batch)
        hugepages.wait_for_moves(timeout=300)  # a move still running would share the cores
        step: dict[str, list[float]] = {s: [] for s in SETTINGS}
        lin: dict[str, list[float]] = {s: [] for s in SETTINGS}
        products: dict[str, int] = {}
        for r in range(args.rounds):
            k = r % len(SETTINGS)
            for name in SETTINGS[k:] + SETTINGS[:k]:
                current[0] = fns[name]
                llm.runner.execute(batch)  # untimed: the setting's own cache state
                inside[0], calls[0] = 0.0, 0
                start = time.perf_counter()
                llm.runner.execute(batch)
                step[name].append(time.perf_counter() - start)
                lin[name].append(inside[0])
                products[name] = calls[0]
        current[0] = fns["kernel"]
        for name in SETTINGS:
            s, i = statistics.median(step[name]), statistics.median(lin[name])
            rest = statistics.median(a - c for a, c in zip(step[name], lin[name]))
            print(f"{b:>5} {name:<8} {s * 1e3:8.1f} {i * 1e3:13.1f} {rest * 1e3:8.1f} "
                  f"{products[name]:8d}")
    llm.shutdown()


if __name__ == "__main__":
    main()
