"""Warm start-up of ``LLM(model_shape=...)`` in a fresh process: process start to first token.

Each measurement is a new Python process (``--child``) that records, from its start (before
importing torch): importing forwardkit, building ``LLM`` (model with seeded random weights,
KV cache, loading the compiled pieces from the cache) and generating one token for a prompt.
A first, untimed run fills the compile cache (it is the cold start); the timed runs then find
it warm. The parent prints every run and the medians.

    python benchmarks/llm_startup.py [--model-shape llama-3.2-1b] [--prompt-len 64] [--repeat 3]
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


def child(shape: str, prompt_len: int) -> None:
    from forwardkit import LLM, SamplingParams

    imported = time.perf_counter() - _START
    llm = LLM(model_shape=shape)
    built = time.perf_counter() - _START
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompt_token_ids=[[7] * prompt_len], sampling_params=params, use_tqdm=False)
    first = time.perf_counter() - _START
    print(json.dumps({"import_s": imported, "llm_s": built - imported,
                      "first_token_s": first - built, "total_s": first}))


def _run(shape: str, prompt_len: int) -> dict[str, float]:
    proc = subprocess.run([sys.executable, __file__, "--child", "--model-shape", shape,
                           "--prompt-len", str(prompt_len)], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", default="llama-3.2-1b")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prompt_len < 1 or args.repeat < 1:
        parser.error(f"--prompt-len and --repeat must be >= 1, got {args.prompt_len} and {args.repeat}")
    if args.child:
        child(args.model_shape, args.prompt_len)
        return
    print(f"priming the compile cache for {args.model_shape} (untimed) ...", flush=True)
    _run(args.model_shape, args.prompt_len)
    runs = []
    for i in range(args.repeat):
        r = _run(args.model_shape, args.prompt_len)
        runs.append(r)
        print(f"run {i + 1}/{args.repeat}: import {r['import_s']:.2f} s, LLM() {r['llm_s']:.2f} s, "
              f"first token {r['first_token_s']:.2f} s, total {r['total_s']:.2f} s", flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"median: import {med['import_s']:.2f} s, LLM() {med['llm_s']:.2f} s, first token "
          f"{med['first_token_s']:.2f} s, total {med['total_s']:.2f} s (warm cache, fresh process)")


if __name__ == "__main__":
    main()
