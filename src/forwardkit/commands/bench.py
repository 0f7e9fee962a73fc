"""``forwardkit bench``: step latency of eager PyTorch, stock torch.compile and forwardkit.

    forwardkit bench                         # built-in model, decode-heavy trace, default -O
    forwardkit bench --quick --json out.json --plot out.png
    forwardkit bench --model ./ckpt --trace mixed -O3
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from forwardkit.bench.trace import BUILTIN_TRACES

__all__ = ["register", "run"]

DEFAULT_STEPS, QUICK_STEPS = 160, 32
DEFAULT_WARMUP, QUICK_WARMUP = 16, 8


def _contender_list(text: str) -> list[str]:
    from forwardkit.bench.contenders import CONTENDER_NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CONTENDER_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown contender(s) {bad or text!r}; choose from {','.join(CONTENDER_NAMES)}"
        )
    return names


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand."""
    from forwardkit.config.args import add_engine_args

    parser = subparsers.add_parser(
        "bench",
        help="measure step latency: eager vs torch.compile vs forwardkit",
        description="Run a serving-like trace of decode batches and prefill chunks through the "
                    "reference engine's model runner for each contender (eager PyTorch, stock "
                    "torch.compile(dynamic=True), forwardkit with the resolved config), "
                    "interleaved step by step, and report median/p99 step latency, tokens/s, "
                    "speed-up over eager, start-up time, recompilations and padding.",
    )
    add_engine_args(parser)
    parser.set_defaults(max_num_batched_tokens=512, max_num_seqs=64)
    g = parser.add_argument_group("benchmark")
    g.add_argument("--trace", default="decode-heavy", metavar="NAME|FILE",
                   help=f"step trace: one of {', '.join(BUILTIN_TRACES)} (default decode-heavy), or a "
                        "JSON file with a list of steps (an int = tokens in the step: a decode batch "
                        "when <= 64, else a prefill chunk; or {\"query_lens\": [...], "
                        "\"context_lens\": [...]})")
    g.add_argument("--steps", type=int, default=None, metavar="N",
                   help=f"timed steps of a built-in trace (default {DEFAULT_STEPS}; {QUICK_STEPS} "
                        "with --quick)")
    g.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                   help=f"untimed steps before timing (default {DEFAULT_WARMUP}; {QUICK_WARMUP} with --quick)")
    g.add_argument("--contenders", type=_contender_list, default=None, metavar="LIST",
                   help="comma-separated subset of eager,torch.compile,forwardkit (default: all)")
    g.add_argument("--quick", action="store_true",
                   help="a short run for smoke tests (fewer steps)")
    g.add_argument("--seed", type=int, default=0, help="seed of the trace and token ids (default 0)")
    g.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="also write the figures as JSON to FILE")
    g.add_argument("--plot", dest="plot_path", default=None, metavar="FILE.png",
                   help="draw median step latency by token count per contender (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
    return parser


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--steps", args.steps), ("--warmup-steps", args.warmup_steps)):
        if value is not None and value < (1 if flag == "--steps" else 0):
            raise ValueError(f"{flag} must be >= {1 if flag == '--steps' else 0}, got {value}")
    if args.plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'forwardkit[plot]'") from None
    for path in (args.json_path, args.plot_path):
        if path is not None:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise ValueError(f"cannot write {path!r}: directory {parent!r} does not exist")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the report."""
    from forwardkit.bench.contenders import CONTENDER_NAMES
    from forwardkit.bench.harness import run_bench
    from forwardkit.bench.trace import load_trace

    _check(args)
    steps_n = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    warmup = args.warmup_steps if args.warmup_steps is not None else (
        QUICK_WARMUP if args.quick else DEFAULT_WARMUP)
    hf_config = None
    if args.model is None:
        from forwardkit.models.default import default_hf_config

        hf_config = default_hf_config()
    steps = load_trace(args.trace, steps_n, seed=args.seed, max_tokens=args.max_num_batched_tokens)
    names = args.contenders or list(CONTENDER_NAMES)
    report = run_bench(args, names, steps, trace_name=args.trace, hf_config=hf_config,
                       warmup_steps=warmup, seed=args.seed, progress=not args.no_progress)
    out = sys.stdout
    print(f"\nforwardkit bench: {len(steps)} steps of the {args.trace} trace "
          f"({sum(s.num_tokens for s in steps)} tokens), model "
          f"{args.model or 'built-in default'}, platform {report.platform}, "
          f"config hash {report.config_hash}", file=out)
    print(f"machine: {report.machine}\n", file=out)
    print(report.format_table(), file=out)
    print("\nvs eager = eager median / contender median (higher is faster); startup = build, "
          "compile, capture and first step\n", file=out)
    print(report.format_batchsize_table("forwardkit" if "forwardkit" in names else names[0]), file=out)
    if args.json_path:
        report.write_json(args.json_path)
        print(f"\nwrote {args.json_path}", file=out)
    if args.plot_path:
        report.plot(args.plot_path)
        print(f"wrote {args.plot_path}", file=out)
    return 0
