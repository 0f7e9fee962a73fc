"""``forwardkit config``: resolve an engine config from vLLM-style flags and print it.

Shows what the engine would run with: optimisation level, compilation and cudagraph mode,
capture sizes with their padding table, compile ranges, splitting and custom ops, and the
config hash. ``--json`` prints the same as one JSON object. ``--platform cuda`` resolves
the CUDA configuration on any machine.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from forwardkit.config.args import add_engine_args, engine_config_from_args
from forwardkit.config.engine import EngineConfig

__all__ = ["padding_runs", "register", "summarize"]


def padding_runs(table: list[int] | None) -> list[tuple[int, int, int]]:
    """Runs ``(first, last, padded)`` of batch sizes >= 1 that pad to the same capture size."""
    runs: list[tuple[int, int, int]] = []
    for n, padded in enumerate(table or []):
        if n == 0:
            continue
        if runs and runs[-1][2] == padded and runs[-1][1] == n - 1:
            runs[-1] = (runs[-1][0], n, padded)
        else:
            runs.append((n, n, padded))
    return runs


def _format_runs(runs: list[tuple[int, int, int]]) -> str:
    if not runs:
        return "none (no CUDA graphs)"
    return ", ".join(f"{a}->{p}" if a == b else f"{a}-{b}->{p}" for a, b, p in runs)


def summarize(cfg: EngineConfig) -> dict[str, Any]:
    """The resolved facts ``forwardkit config`` shows, as JSON-able values."""
    cc = cfg.compilation_config
    model = cfg.require_model_config()
    return {
        "optimization_level": f"O{int(cfg.optimization_level)}",
        "platform": cfg.platform.name,
        "model": model.model or "(built-in default model)",
        "architectures": model.architectures,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "data_parallel_size": cfg.parallel_config.data_parallel_size,
        "mode": None if cc.mode is None else cc.mode.name,
        "cudagraph_mode": None if cc.cudagraph_mode is None else cc.cudagraph_mode.name,
        "cudagraph_capture_sizes": cc.cudagraph_capture_sizes,
        "max_cudagraph_capture_size": cc.max_cudagraph_capture_size,
        "padding": [list(run) for run in padding_runs(cc.bs_to_padded_graph_size)],
        "compile_ranges": [[r.start, r.end] for r in cc.get_compile_ranges()],
        "compile_sizes": None if cc.compile_sizes is None else sorted(cc.compile_sizes, key=str),
        "splitting_ops": cc.splitting_ops,
        "custom_ops": cc.custom_ops,
        "backend": cc.backend,
        "pass_config": cc.pass_config.to_dict(),
        "cudagraph_num_of_warmups": cc.cudagraph_num_of_warmups,
        "hash": cfg.compute_hash(),
        "compilation_config": cc.to_dict(),
    }


def _text(info: dict[str, Any], cfg: EngineConfig) -> str:
    cc = cfg.compilation_config
    mode = "None" if cc.mode is None else f"{cc.mode.name} ({int(cc.mode)})"
    passes = ", ".join(f"{k}={v}" for k, v in info["pass_config"].items() if v not in (None, False)) or "none"
    rows = [
        ("optimization level", info["optimization_level"]),
        ("platform", info["platform"]),
        ("model", f"{info['model']} {info['architectures']}" if info["model"] else "none"),
        ("batch limits", f"max_num_seqs={info['max_num_seqs']} "
                         f"max_num_batched_tokens={info['max_num_batched_tokens']}"),
        ("data parallel size", info["data_parallel_size"]),
        ("mode", mode),
        ("backend", info["backend"]),
        ("cudagraph mode", info["cudagraph_mode"]),
        ("capture sizes", info["cudagraph_capture_sizes"]),
        ("max capture size", info["max_cudagraph_capture_size"]),
        ("padding", _format_runs(padding_runs(cc.bs_to_padded_graph_size))),
        ("compile ranges", ", ".join(str(r) for r in cc.get_compile_ranges()) or "none"),
        ("compile sizes", info["compile_sizes"]),
        ("splitting ops", info["splitting_ops"]),
        ("custom ops", info["custom_ops"]),
        ("passes on", passes),
        ("warm-up runs", info["cudagraph_num_of_warmups"]),
        ("hash", info["hash"]),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def run(args: argparse.Namespace) -> int:
    """Resolve the config from ``args`` and print it (text or ``--json``)."""
    cfg = engine_config_from_args(args)
    info = summarize(cfg)
    print(json.dumps(info, indent=2) if args.json else _text(info, cfg))
    return 0


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``forwardkit config`` to the CLI."""
    parser = subparsers.add_parser(
        "config",
        help="resolve and print the engine/compilation config for the given flags",
        description="Resolve an engine config from vLLM-style flags (-O3, -O.cudagraph_mode=FULL, "
                    "--compilation-config '{...}') and print the resolved compilation config: "
                    "modes, capture sizes, padding table, compile ranges, splitting and custom ops.",
    )
    add_engine_args(parser)
    parser.add_argument("--json", action="store_true", help="print the resolved config as JSON")
    parser.set_defaults(func=run)
    return parser
