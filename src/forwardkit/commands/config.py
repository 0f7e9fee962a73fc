"""``forwardkit config``: resolve an engine config from vLLM-style flags and print it.

Shows what the engine would run with: optimisation level, compilation and cudagraph mode,
capture sizes with their padding table, compile ranges, splitting and custom ops, and the
config hash. ``--json`` prints the same as one JSON object. ``--platform cuda`` resolves
the CUDA configuration on any machine.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from forwardkit.commands.engine_flags import add_engine_args

if TYPE_CHECKING:
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
    from forwardkit.commands.weight_formats import weight_formats
    from forwardkit.config.model import embedding_quantization

    formats = weight_formats(cfg)
    cc = cfg.compilation_config
    model = cfg.require_model_config()
    pc, sched = cfg.parallel_config, cfg.scheduler_config
    return {
        "optimization_level": f"O{int(cfg.optimization_level)}",
        "platform": cfg.platform.name,
        "model": model.model or "(built-in default model)",
        "architectures": model.architectures,
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_model_len": model.max_model_len,
        "enforce_eager": model.enforce_eager,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "enable_chunked_prefill": sched.enable_chunked_prefill,
        "block_size": cfg.cache_config.block_size,
        "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
        "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
        "prefix_caching_hash_algo": cfg.cache_config.prefix_caching_hash_algo,
        "quantization": model.quantization,
        "embedding_quantization": embedding_quantization(model.quantization),
        "speculative_config": (None if cfg.speculative_config is None else
                               {k: getattr(cfg.speculative_config, k) for k in (
                                   "method", "num_speculative_tokens", "prompt_lookup_min",
                                   "prompt_lookup_max", "disable_by_batch_size")}),
        "tensor_parallel_size": pc.tensor_parallel_size,
        "data_parallel_size": pc.data_parallel_size,
        "data_parallel_rank": pc.data_parallel_rank,
        "enable_expert_parallel": pc.enable_expert_parallel,
        "all2all_backend": pc.all2all_backend,
        "enable_dbo": pc.enable_dbo,
        "ubatch_size": pc.ubatch_size,
        "dbo_decode_token_threshold": pc.dbo_decode_token_threshold,
        "dbo_prefill_token_threshold": pc.dbo_prefill_token_threshold,
        # the mode that runs (resolution lowers it to NONE under enforce_eager)
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
        "weight_formats": None if formats is None else formats.to_dict(),
        "hash": cfg.compute_hash(),
        "compilation_config": cc.to_dict(),
    }


def _weight_rows(cfg: EngineConfig) -> list[tuple[str, str]]:
    from forwardkit.commands.weight_formats import weight_formats

    formats = weight_formats(cfg)
    return [] if formats is None else formats.text_rows()


def _quantization_text(info: dict[str, Any], cfg: EngineConfig) -> str:
    from forwardkit.config.gguf import is_gguf_path

    if info["quantization"] is not None:
        return (f"{info['quantization']} projections, {info['embedding_quantization']} token "
                "embedding and LM head")
    if is_gguf_path(cfg.require_model_config().model):  # nothing quantized on load
        return "the GGUF file's tensor types (weights below)"
    return "none (model dtype)"


def _text(info: dict[str, Any], cfg: EngineConfig) -> str:
    cc = cfg.compilation_config
    mode = "None" if cc.mode is None else f"{cc.mode.name} ({int(cc.mode)})"
    passes = ", ".join(f"{k}={v}" for k, v in info["pass_config"].items() if v not in (None, False)) or "none"
    rows = [
        ("optimization level", info["optimization_level"]),
        ("platform", info["platform"]),
        ("model", f"{info['model']} {info['architectures']}" if info["model"] else "none"),
        ("dtype", info["dtype"]),
        ("max model len", info["max_model_len"]),
        ("enforce eager", info["enforce_eager"]),
        ("batch limits", f"max_num_seqs={info['max_num_seqs']} "
                         f"max_num_batched_tokens={info['max_num_batched_tokens']} "
                         f"chunked_prefill={info['enable_chunked_prefill']}"),
        ("KV cache", f"block_size={info['block_size']} num_gpu_blocks="
                     f"{info['num_gpu_blocks'] if info['num_gpu_blocks'] is not None else 'auto'}"),
        ("prefix caching", f"{'on' if info['enable_prefix_caching'] else 'off'} "
                           f"(hash {info['prefix_caching_hash_algo']})"),
        ("quantization", _quantization_text(info, cfg)),
        *_weight_rows(cfg),
        ("speculative", "off" if info["speculative_config"] is None else
         " ".join(f"{k}={v}" for k, v in info["speculative_config"].items())),
        ("parallel", f"tp={info['tensor_parallel_size']} dp={info['data_parallel_size']} "
                     f"dp_rank={info['data_parallel_rank']} "
                     f"expert_parallel={info['enable_expert_parallel']} "
                     f"all2all={info['all2all_backend']}"),
        ("micro-batching", f"dbo={info['enable_dbo']} ubatch_size={info['ubatch_size']} "
                           f"thresholds decode={info['dbo_decode_token_threshold']} "
                           f"prefill={info['dbo_prefill_token_threshold']}"),
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
    from forwardkit.commands.flag_config import engine_config_from_args

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
