"""``forwardkit bench``: step latency of eager PyTorch, stock torch.compile and forwardkit.

    forwardkit bench                         # built-in model, decode-heavy trace, default -O
    forwardkit bench --quick --json out.json --plot out.png
    forwardkit bench --model ./ckpt --trace mixed -O3
    forwardkit bench --model-shape llama-3.2-1b --generation    # end-to-end generate vs transformers
    forwardkit bench -tp 2                    # the same trace on 2 tensor-parallel ranks
    forwardkit bench --workload all --quick   # shared-prefix traffic, prefix caching on vs off
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from forwardkit.bench.generation_cli import add_generation_args, run_generation
from forwardkit.bench.prefix_workloads import add_workload_args, run_workloads
from forwardkit.bench.trace import BUILTIN_TRACES
from forwardkit.commands.engine_flags import DEFAULT_MAX_NUM_BATCHED_TOKENS, strict_int

if TYPE_CHECKING:
    from forwardkit.bench.report import BenchReport

__all__ = ["register", "run"]

DEFAULT_STEPS, QUICK_STEPS = 160, 32
# the named shapes of forwardkit.config.model_shapes, for --help without importing the config
# package (torch); a test keeps the two equal
MODEL_SHAPE_NAMES = ("default", "default-moe", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b", "mixtral-small")
DEFAULT_WARMUP, QUICK_WARMUP = 16, 8
DP_TIMEOUT_S = 3600.0
TRACE_BATCH_LIMITS = (64, 512)
"""(max_num_seqs, max_num_batched_tokens) of the step trace and ``--workload`` when not given
(the workloads' figures in the README were measured with them);
``--generation`` sizes requests by ``--batch-sizes`` and leaves the token budget to the engine
(2048), as llama.cpp gets every prompt of a batch in one pass."""


def _under_torchrun(world_size: int) -> bool:
    """Whether this process is one rank of a torchrun launch of ``world_size`` (DP x TP) ranks."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        return False
    if int(world) != world_size:
        raise ValueError(f"--data-parallel-size x --tensor-parallel-size = {world_size} but torchrun "
                         f"started WORLD_SIZE={world} ranks")
    return True


def _prepare_dp(args: argparse.Namespace, hf_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """DP needs a mixture-of-experts model (ranks meet in the MoE layers); pick or check it."""
    if args.model_shape is not None:
        if not (hf_config or {}).get("num_local_experts"):
            raise ValueError(f"--data-parallel-size > 1 needs a mixture-of-experts model; "
                             f"--model-shape {args.model_shape} has no experts (try mixtral-small)")
        return hf_config
    if args.model is None:
        from forwardkit.models.default import default_moe_hf_config

        print("forwardkit bench: data parallel runs use the built-in MoE model "
              "(8 experts, top-2, experts split over the ranks)", file=sys.stderr)
        args.enable_expert_parallel = True
        return default_moe_hf_config()
    from forwardkit.config.model import ModelConfig

    if not ModelConfig.from_pretrained(args.model).is_moe:
        raise ValueError(f"--data-parallel-size > 1 needs a mixture-of-experts model; {args.model} "
                         "is dense (run it with one rank, or pass a Mixtral-family checkpoint)")
    return hf_config


def _bench_rank(rank: int, nprocs: int, port: int | None, args: argparse.Namespace,
                names: list[str], steps_n: int, warmup: int, hf_config: dict[str, Any] | None,
                ) -> BenchReport | None:
    """One rank of the benchmark (global rank ``rank`` of DP x TP): every DP replica its own
    share of traffic (seed + DP rank), the TP ranks of a replica the same steps, in lockstep."""
    from forwardkit.bench.harness import run_bench
    from forwardkit.bench.trace import load_trace
    from forwardkit.distributed import destroy_distributed, init_distributed
    from forwardkit.engine.tp import share_cpu_threads

    tp = int(args.tensor_parallel_size or 1)
    dp_rank = rank // tp
    args.data_parallel_rank = dp_rank
    share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", nprocs)))  # ranks share the cores
    if port is not None:
        init_distributed(world_size=nprocs, rank=rank, master_addr="127.0.0.1", master_port=port,
                         tensor_parallel_size=tp)
    else:  # under torchrun: ranks and rendezvous come from its environment
        init_distributed(tensor_parallel_size=tp)
    try:
        steps = load_trace(args.trace, steps_n, seed=args.seed + dp_rank,
                           max_tokens=args.max_num_batched_tokens, max_len=args.trace_max_len)
        report = run_bench(args, names, steps, trace_name=f"{args.trace} (rank {rank} of {nprocs})",
                           hf_config=hf_config, warmup_steps=warmup, seed=args.seed + dp_rank,
                           progress=rank == 0 and not args.no_progress)
    finally:
        destroy_distributed()
    return report if rank == 0 else None


def _contender_list(text: str) -> list[str]:
    from forwardkit.bench.contenders import DBO_CONTENDER
    from forwardkit.bench.generation import GENERATION_CONTENDERS, SPEC_CONTENDER

    known = (*GENERATION_CONTENDERS, SPEC_CONTENDER, DBO_CONTENDER)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown contender(s) {bad or text!r}; choose from {','.join(known)} "
            f"(transformers and llama.cpp with --generation only, {DBO_CONTENDER} with -dp > 1 "
            "only)"
        )
    return names


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand."""
    from forwardkit.commands.engine_flags import add_engine_args

    parser = subparsers.add_parser(
        "bench",
        help="measure step latency: eager vs torch.compile vs forwardkit",
        description="Run a serving-like trace of decode batches and prefill chunks through the "
                    "reference engine's model runner for each contender (eager PyTorch, stock "
                    "torch.compile(dynamic=True), forwardkit with the resolved config), "
                    "interleaved step by step, and report median/p99 step latency, tokens/s, "
                    "speed-up over eager, start-up time, recompilations and padding.",
    )
    seqs, tokens = TRACE_BATCH_LIMITS
    add_engine_args(parser, batch_defaults=(
        f"default {seqs}; with --generation the largest --batch-sizes",
        f"default {tokens}; with --generation the engine's {DEFAULT_MAX_NUM_BATCHED_TOKENS} "
        "(at least the largest --batch-sizes)"))
    g = parser.add_argument_group("benchmark")
    g.add_argument("--model-shape", default=None, metavar="NAME",
                   help=f"a real architecture's shape with seeded random weights, no download: "
                        f"{', '.join(MODEL_SHAPE_NAMES)} (instead of --model)")
    add_generation_args(parser)
    add_workload_args(parser)
    g.add_argument("--trace", default="decode-heavy", metavar="NAME|FILE",
                   help=f"step trace: one of {', '.join(BUILTIN_TRACES)} (default decode-heavy), or a "
                        "JSON file with a list of steps (an int = tokens in the step: a decode batch "
                        "when <= 64, else a prefill chunk; or {\"query_lens\": [...], "
                        "\"context_lens\": [...]})")
    g.add_argument("--steps", type=strict_int, default=None, metavar="N",
                   help=f"timed steps of a built-in trace (default {DEFAULT_STEPS}; {QUICK_STEPS} "
                        "with --quick)")
    g.add_argument("--warmup-steps", type=strict_int, default=None, metavar="N",
                   help=f"untimed steps before timing (default {DEFAULT_WARMUP}; {QUICK_WARMUP} with --quick)")
    g.add_argument("--contenders", type=_contender_list, default=None, metavar="LIST",
                   help="comma-separated subset of eager,torch.compile,forwardkit (default: all); "
                        "with --generation also transformers and llama.cpp (the latter when "
                        "llama-cpp-python is installed); with -dp > 1 also forwardkit+dbo "
                        "(forwardkit with --enable-dbo; in the default list then); with --generation and "
                        "--speculative-config also forwardkit+spec (the only contender that "
                        "speculates; in the default list then)")
    g.add_argument("--quick", action="store_true",
                   help="a short run for smoke tests (fewer steps)")
    g.add_argument("--seed", type=strict_int, default=0, help="seed of the trace and token ids (default 0)")
    g.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="also write the figures as JSON to FILE")
    g.add_argument("--plot", dest="plot_path", default=None, metavar="FILE.png",
                   help="draw median step latency by token count per contender (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
    return parser


def _check_mode_flags(args: argparse.Namespace) -> None:
    """Refuse flags the chosen mode would silently ignore."""
    if not args.generation:
        for flag, value in (("--profile", args.profile), ("--batch-sizes", args.batch_sizes),
                            ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens),
                            ("--repeats", args.repeats),
                            ("--bandwidth-probe", args.bandwidth_probe)):
            if value not in (None, False):
                raise ValueError(f"{flag} needs --generation (the step trace does not use it)")
    else:
        for flag, value in (("--steps", args.steps), ("--warmup-steps", args.warmup_steps),
                            ("--plot", args.plot_path)):
            if value is not None:
                raise ValueError(f"{flag} is a step-trace flag; --generation does not use it")
        if args.trace != "decode-heavy":
            raise ValueError("--trace is a step-trace flag; --generation does not use it")
    if args.trace not in BUILTIN_TRACES and not os.path.isfile(args.trace):
        raise ValueError(f"trace {args.trace!r} is neither a built-in trace "
                         f"{list(BUILTIN_TRACES)} nor a file")
    if args.steps is not None and args.trace not in BUILTIN_TRACES:
        raise ValueError(f"--steps sets the length of a built-in trace; the file {args.trace!r} "
                         "runs all its steps")


def _model_len(args: argparse.Namespace, hf_config: dict[str, Any] | None) -> int:
    """The max_model_len the engine will run with (--max-model-len, else the model's)."""
    from forwardkit.commands.flag_config import engine_config_from_args

    cfg = engine_config_from_args(args, default_hf_config=hf_config)  # bad flags fail here
    return int(cfg.require_model_config().get_max_model_len())


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


def _ranks_note(dp: int, tp: int) -> str:
    parts = [f"{n} {kind} ranks" for n, kind in ((dp, "DP"), (tp, "TP")) if n > 1]
    return f", {' x '.join(parts)} (figures of rank 0)" if parts else ""


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the report."""
    from forwardkit.bench.contenders import CONTENDER_NAMES, DBO_CONTENDER
    from forwardkit.bench.harness import run_bench
    from forwardkit.bench.trace import load_trace

    _check(args)
    _check_mode_flags(args)
    if args.model_shape is not None and args.model is not None:
        raise ValueError(f"give --model or --model-shape, not both (got {args.model!r} and "
                         f"{args.model_shape!r})")
    dp = int(args.data_parallel_size or 1)
    if DBO_CONTENDER in (args.contenders or ()) and (args.generation or dp < 2):
        raise ValueError(f"--contenders {DBO_CONTENDER} needs the step trace on data-parallel "
                         "ranks (-dp 2 or more, no --generation): micro-batching is agreed by "
                         "DP ranks")
    if not args.generation:
        args.max_num_seqs = args.max_num_seqs or TRACE_BATCH_LIMITS[0]
        args.max_num_batched_tokens = args.max_num_batched_tokens or TRACE_BATCH_LIMITS[1]
    if args.workload:
        if (args.generation or dp > 1 or args.contenders
                or getattr(args, "enable_prefix_caching", None) is not None):
            raise ValueError("--workload runs forwardkit with prefix caching on and off on its "
                             "own: leave out --generation, --contenders, -dp and "
                             "--[no-]enable-prefix-caching")
        return run_workloads(args)
    if args.generation:
        return run_generation(args)
    steps_n = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    warmup = args.warmup_steps if args.warmup_steps is not None else (
        QUICK_WARMUP if args.quick else DEFAULT_WARMUP)
    from forwardkit.config.model_shapes import BUILTIN_MODEL_SHAPE, model_shape_config

    hf_config = None
    if args.model is None:
        hf_config = model_shape_config(args.model_shape or BUILTIN_MODEL_SHAPE)
    names = args.contenders or list(CONTENDER_NAMES) + ([DBO_CONTENDER] if dp > 1 else [])
    for only_generation in ("transformers", "llama.cpp", "forwardkit+spec"):
        if only_generation in names:
            raise ValueError(f"--contenders {only_generation} needs --generation (the step trace "
                             "runs forwardkit's model runner); step-trace contenders: "
                             f"{','.join(CONTENDER_NAMES)}")
    tp = int(args.tensor_parallel_size or 1)
    if dp > 1:
        hf_config = _prepare_dp(args, hf_config)
    args.trace_max_len = _model_len(args, hf_config)  # bad flags fail before any build / spawn
    steps = load_trace(args.trace, steps_n, seed=args.seed, max_tokens=args.max_num_batched_tokens,
                       max_len=args.trace_max_len)
    if dp > 1 or tp > 1:
        job = (args, names, steps_n, warmup, hf_config)
        if _under_torchrun(dp * tp):
            report = _bench_rank(int(os.environ["RANK"]), dp * tp, None, *job)
            if report is None:
                return 0  # only rank 0 reports
        else:
            from forwardkit.distributed.launch import spawn

            print(f"forwardkit bench: spawning {dp * tp} local ranks ({dp} data-parallel x {tp} "
                  "tensor-parallel, gloo)", file=sys.stderr)
            first = spawn(_bench_rank, dp * tp, args=job, timeout_s=DP_TIMEOUT_S)[0]
            assert first is not None  # rank 0 returns its report
            report = first
    else:
        report = run_bench(args, names, steps, trace_name=args.trace, hf_config=hf_config,
                           warmup_steps=warmup, seed=args.seed, progress=not args.no_progress)
    out = sys.stdout
    print(f"\nforwardkit bench: {len(steps)} steps of the {args.trace} trace "
          f"({sum(s.num_tokens for s in steps)} tokens), model "
          f"{args.model or args.model_shape or ('built-in MoE' if dp > 1 else 'built-in default')}"
          f"{_ranks_note(dp, tp)}, platform {report.platform}, "
          f"config hash {report.config_hash}", file=out)
    print(f"machine: {report.machine}\n", file=out)
    print(report.format_table(), file=out)
    print("\nvs eager = eager median / contender median (higher is faster); startup = build, "
          "compile, capture and first step\n", file=out)
    print(report.format_batchsize_table("forwardkit" if "forwardkit" in names else names[0]), file=out)
    comm = report.format_comm_table()
    if comm:
        print("\n" + comm, file=out)
    if args.json_path:
        report.write_json(args.json_path)
        print(f"\nwrote {args.json_path}", file=out)
    if args.plot_path:
        report.plot(args.plot_path)
        print(f"wrote {args.plot_path}", file=out)
    return 0
