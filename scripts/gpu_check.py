"""The prepared GPU check (driven by ``scripts/gpu_check.sh``): GPU-marked tests, then
``forwardkit bench`` on the built-in model and on a real model shape, for eager, stock
``torch.compile(mode="reduce-overhead")`` and forwardkit at three CUDA-graph modes; one
summary table at the end.

``--dry-run`` runs the same steps on the CPU with a tiny trace (the graph modes resolve to
NONE there), so the script itself is tested without a GPU. Every bench run is a child process
of this script (``--child``), with its JSON written to the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

GRAPH_MODES = ("PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
REDUCE_OVERHEAD = "torch.compile(reduce-overhead)"


def _child(argv: list[str], reduce_overhead: bool) -> int:
    """Run ``forwardkit bench`` in this process; with ``reduce_overhead`` the bench's stock
    ``torch.compile`` contender compiles with Inductor's CUDA graphs on, which is what
    ``torch.compile(mode="reduce-overhead")`` selects (still counting its compiles)."""
    if reduce_overhead:
        from forwardkit.bench import contenders

        if not hasattr(contenders, "_counting_inductor"):
            print("gpu_check: the bench's torch.compile contender changed; running it without "
                  "reduce-overhead", file=sys.stderr)
        else:
            def counting_reduce_overhead(calls: list[int]) -> Any:
                import torch

                options = torch._inductor.list_mode_options("reduce-overhead")

                def backend(gm: Any, example_inputs: list[Any]) -> Any:
                    from torch._inductor.compile_fx import compile_fx

                    calls[0] += 1
                    return compile_fx(gm, example_inputs, config_patches=options)

                return backend

            contenders._counting_inductor = counting_reduce_overhead
    from forwardkit.cli import main

    return main(argv)


def _bench_accepts(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-c", "from forwardkit.cli import main; main(['bench', '--help'])"],
                         capture_output=True, text=True, check=False)
    return flag in out.stdout


def _run(cmd: list[str], timeout_s: float, log: Any) -> tuple[int, float]:
    start = time.perf_counter()
    print("$ " + " ".join(cmd), file=log, flush=True)
    try:
        rc = subprocess.run(cmd, timeout=max(timeout_s, 1), check=False).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    return rc, time.perf_counter() - start


def _rows(json_path: str, model: str, label_of: dict[str, str]) -> list[dict[str, Any]]:
    with open(json_path, encoding="utf-8") as f:
        data = json.load(f)
    rows = []
    for name, fig in data["contenders"].items():
        rows.append({"model": model, "contender": label_of.get(name, name), **fig,
                     "platform": data.get("platform", "?")})
    return rows


def _table(rows: list[dict[str, Any]], notes: list[str]) -> str:
    head = (f"{'model':<18}{'contender':<34}{'median ms':>10}{'p99 ms':>10}{'tok/s':>10}"
            f"{'vs eager':>10}{'recompiles':>11}  graph modes (steps)")
    lines = [head, "-" * len(head)]
    eager = {r["model"]: r["median_step_ms"] for r in rows if r["contender"] == "eager"}
    for r in rows:
        base = eager.get(r["model"])
        ratio = base / r["median_step_ms"] if base and r["median_step_ms"] else float("nan")
        modes = "/".join(f"{m} {n}" for m, n in (r.get("graph_modes") or {}).items()) or "-"
        lines.append(f"{r['model']:<18}{r['contender']:<34}{r['median_step_ms']:>10.3f}"
                     f"{r['p99_step_ms']:>10.3f}{r['tokens_per_s']:>10.0f}{ratio:>9.2f}x"
                     f"{r['recompiles']:>11d}  {modes}")
    return "\n".join(lines + [f"note: {n}" for n in notes])


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns non-zero when a step failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="same steps on the CPU, tiny sizes")
    p.add_argument("--model-shape", default=os.environ.get("MODEL_SHAPE", "llama-3.2-1b"),
                   help="the real-shape preset of `forwardkit bench --model-shape` (default "
                        "llama-3.2-1b; env MODEL_SHAPE)")
    p.add_argument("--trace", default="mixed", help="bench trace (default mixed)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per bench run")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "gpu_check_out",
                   help="where the bench JSON files go (default $OUT, else gpu_check_out)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="total time budget; runs that no longer fit are skipped (default 480)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the GPU-marked tests")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reduce-overhead", action="store_true", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.child:
        return _child([a for a in rest if a != "--"], args.reduce_overhead)

    start = time.perf_counter()
    os.makedirs(args.out_dir, exist_ok=True)
    log, failures, notes, rows = sys.stderr, [], [], []

    def left() -> float:
        return args.budget_s - (time.perf_counter() - start)

    if not args.skip_tests:
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
        rc, took = _run(cmd, min(left(), 200.0), log)
        notes.append(f"GPU-marked tests: exit {rc} in {took:.0f} s"
                     + (" (they skip without CUDA)" if args.dry_run else ""))
        if rc not in (0, 5):  # 5: nothing collected
            failures.append("gpu tests")

    steps = args.steps or (4 if args.dry_run else 96)
    common = ["bench", "--trace", args.trace, "--steps", str(steps), "--warmup-steps",
              "1" if args.dry_run else "8", "--no-progress"]
    if args.dry_run:
        common += ["--platform", "cpu", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    else:
        common += ["--platform", "cuda"]
    models: list[tuple[str, list[str]]] = [("built-in", [])]
    if not _bench_accepts("--model-shape"):
        notes.append(f"{args.model_shape}: skipped, `forwardkit bench` does not accept --model-shape")
    elif args.dry_run and not os.environ.get("GPU_CHECK_SHAPE_IN_DRY_RUN"):
        notes.append(f"{args.model_shape}: skipped in the dry run (too large for a CPU smoke run; "
                     "GPU_CHECK_SHAPE_IN_DRY_RUN=1 runs it)")
    else:
        models.append((args.model_shape, ["--model-shape", args.model_shape]))

    plan = []
    for model, model_args in models:
        plan.append((model, model_args, "baselines", ["--contenders", "eager,torch.compile"], True,
                     {"torch.compile": REDUCE_OVERHEAD}))
        plan += [(model, model_args, mode, ["--contenders", "forwardkit", f"-O.cudagraph_mode={mode}"],
                  False, {"forwardkit": f"forwardkit {mode}"}) for mode in GRAPH_MODES]
    for model, model_args, tag, extra, reduce_overhead, labels in plan:
        if left() < 20:
            notes.append(f"{model} {tag}: skipped, the {args.budget_s:.0f} s budget is spent")
            continue
        out = os.path.join(args.out_dir, f"{model}-{tag}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child"]
        cmd += ["--reduce-overhead"] if reduce_overhead else []
        cmd += ["--", *common, *model_args, *extra, "--json", out]
        rc, took = _run(cmd, left(), log)
        if rc != 0 or not os.path.exists(out):
            failures.append(f"{model} {tag}")
            notes.append(f"{model} {tag}: failed (exit {rc}) after {took:.0f} s")
            continue
        rows.extend(_rows(out, model, labels))
    print(f"\ngpu_check{' (dry run, CPU)' if args.dry_run else ''}: trace {args.trace}, "
          f"{steps} timed steps per run, {time.perf_counter() - start:.0f} s in all")
    print(_table(rows, notes))
    if failures:
        print(f"FAILED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
