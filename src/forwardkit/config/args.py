"""vLLM-style engine arguments, shared by ``forwardkit config``, ``generate`` and ``bench``.

``add_engine_args(parser)`` adds the flags; ``engine_config_from_args(ns)`` turns the parsed
namespace into a resolved :class:`~forwardkit.config.engine.EngineConfig`. Accepted forms::

    -O3   -O 3   -O=3   --optimization-level 3          optimisation level O0..O3
    -O.cudagraph_mode=FULL   -O.pass_config.eliminate_noops=false   dotted compilation keys
    --compilation-config '{"mode": 3}'   -cc '{...}'   -cc.mode=3   --compilation-config.mode=3

Dotted values are parsed as JSON when they are valid JSON (``3``, ``false``, ``[1, 2]``) and
kept as strings otherwise (``FULL``); they override keys of ``--compilation-config``. Every
bad value raises a one-line ``ValueError`` naming the flag or key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from forwardkit.config.builder import build_engine_config, one_line_error
from forwardkit.config.compilation import CompilationConfig, CompilationMode
from forwardkit.config.engine import EngineConfig, OptimizationLevel
from forwardkit.config.parallel import ALL2ALL_BACKENDS
from forwardkit.config.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from forwardkit.config.utils import short_repr

__all__ = [
    "FLAG_NAMES",
    "add_engine_args",
    "compilation_overrides_from_args",
    "engine_config_from_args",
    "normalize_engine_argv",
    "one_line_error",
]

_DOTTED = re.compile(r"^(?:-cc|--compilation-config|-O)\.(.*)$")
_NUMBER = re.compile(r"^-?\d+(\.\d*)?$")


def normalize_engine_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite ``-cc.k=v`` / ``--compilation-config.k=v`` to ``-O.k=v`` (argparse can't match them).

    As in vLLM, the value may also follow as the next token (``-cc.mode 3``), unless that
    token is another flag. Tokens after a literal ``--`` are left alone.
    """
    out: list[str] = []
    rest = False
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not rest and token == "--":
            rest = True
        match = None if rest else _DOTTED.match(token)
        if not match:
            out.append(token)
            continue
        key = match.group(1)
        if "=" not in key and i < len(tokens) and tokens[i] != "--" and (
                not tokens[i].startswith("-") or _NUMBER.match(tokens[i])):
            key = f"{key}={tokens[i]}"
            i += 1
        out.append(f"-O.{key}")
    return out


def _install_normalizer(parser: argparse.ArgumentParser) -> None:
    original = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = sys.argv[1:] if args is None else args
        return original(normalize_engine_argv(list(argv)), namespace)

    # NOTE: set on the instance, so it also runs when this parser is a subcommand parser
    # (argparse calls the subparser's parse_known_args with the remaining tokens).
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign,assignment]  # instance patch


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags (model, batch limits, parallelism, optimisation, compilation)."""
    _install_normalizer(parser)
    g = parser.add_argument_group("engine configuration")
    g.add_argument("--model", default=None, metavar="DIR",
                   help="local Hugging Face checkpoint directory (config.json + safetensors); "
                        "default: the built-in small model")
    g.add_argument("--dtype", default=None,
                   help="model dtype: auto (from config.json), float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=positive_int, default=None, metavar="N",
                   help="longest sequence (default: max_position_embeddings of the model)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None, metavar="N",
                   help=f"most requests per step (default {DEFAULT_MAX_NUM_SEQS})")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                   help=f"most tokens per step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}, at least "
                        "max-num-seqs)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over several steps (default on); with "
                        "--no-enable-chunked-prefill max-num-batched-tokens defaults to at least "
                        "max-model-len")
    g.add_argument("--block-size", type=positive_int, default=None, metavar="N",
                   help="tokens per KV-cache block (default 16)")
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=None, metavar="N",
                   help="data-parallel replicas (default 1)")
    g.add_argument("--data-parallel-rank", type=int, default=None, metavar="R",
                   help="this process's data-parallel rank (default 0)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=None, metavar="N",
                   help="tensor-parallel ranks (default 1; used for sequence-parallel sizes)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard MoE experts over data-parallel ranks")
    g.add_argument("--all2all-backend", choices=ALL2ALL_BACKENDS, default=None,
                   help="MoE all-to-all backend (default allgather_reducescatter)")
    g.add_argument("--enable-dbo", action="store_true",
                   help="dual-batch overlap: with data parallelism, split a step every DP rank "
                        "agrees on into two micro-batches so one's MoE communication overlaps "
                        "the other's compute")
    g.add_argument("--ubatch-size", type=int, default=None, metavar="N",
                   help="micro-batches per step when > 1 (without --enable-dbo; default 0)")
    g.add_argument("--dbo-decode-token-threshold", type=positive_int, default=None, metavar="N",
                   help="micro-batch a decode-only step from N tokens (default 32)")
    g.add_argument("--dbo-prefill-token-threshold", type=positive_int, default=None, metavar="N",
                   help="micro-batch a step with a prefill from N tokens (default 512)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile and no CUDA graphs (forces -O0)")
    g.add_argument("--platform", choices=("cuda", "cpu"), default=None,
                   help="resolve for this platform (default: detected); 'cuda' works without a GPU "
                        "for inspecting configs")
    g.add_argument("-O", "--optimization-level", dest="engine_O", action="append", default=[],
                   metavar="LEVEL|.KEY=VALUE",
                   help="optimisation level 0-3 (-O3, -O 3, -O=3; default 2), or a dotted "
                        "compilation-config key: -O.cudagraph_mode=FULL, -O.pass_config.eliminate_noops=false")
    g.add_argument("--compilation-config", "-cc", dest="compilation_config", default=None,
                   metavar="JSON",
                   help="compilation config as a JSON object, e.g. '{\"mode\": 3, "
                        "\"cudagraph_capture_sizes\": [1, 2, 4]}'; single keys: -cc.KEY=VALUE")
    return parser


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:
        raise ValueError(f"compilation-config value nested too deeply: {short_repr(text)}") from None


def _set_dotted(target: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ValueError(f"invalid compilation-config key {key!r} (empty part between dots)")
    node = target
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"compilation-config key {part!r} is not an object; cannot set {key!r}")
        node = child
    node[parts[-1]] = value


def compilation_overrides_from_args(ns: argparse.Namespace) -> tuple[int | None, dict[str, Any]]:
    """(optimisation level or None, compilation-config dict) from ``-O`` / ``-cc`` arguments."""
    level: int | None = None
    config: dict[str, Any] = {}
    raw = getattr(ns, "compilation_config", None)
    if raw is not None:
        text = raw.strip()
        if text.isdigit() or (text.isidentifier() and text.upper() in CompilationMode.__members__):
            config = {"mode": int(text) if text.isdigit() else text.upper()}  # -cc 3, -cc VLLM_COMPILE
        else:
            try:
                config = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--compilation-config is not valid JSON ({exc}): {short_repr(raw)}") from None
            except RecursionError:
                raise ValueError(f"--compilation-config is nested too deeply: {short_repr(raw)}") from None
            if not isinstance(config, dict):
                raise ValueError(f"--compilation-config must be a JSON object or a mode, got {raw!r}")
    for item in getattr(ns, "engine_O", None) or []:
        text = item.strip()
        if text.startswith("."):
            key, sep, value = text[1:].partition("=")
            if not sep or not key:
                raise ValueError(f"invalid -O{text}: expected -O.KEY=VALUE, e.g. -O.cudagraph_mode=FULL")
            _set_dotted(config, key, _parse_value(value))
        elif re.fullmatch(r"\d+", text):
            if int(text) not in {lvl.value for lvl in OptimizationLevel}:
                raise ValueError(f"invalid optimization level {text!r}; expected 0, 1, 2 or 3")
            level = int(text)
        else:
            raise ValueError(
                f"invalid -O value {item!r}; expected a level 0-3 (-O3, -O 3, -O=3) or "
                "-O.KEY=VALUE"
            )
    _check_compilation_keys(config)
    return level, config


def _check_compilation_keys(config: dict[str, Any]) -> None:
    accepted = sorted(f.name for f in dataclasses.fields(CompilationConfig) if f.init)
    for key in config:
        if key not in accepted:
            raise ValueError(f"unknown compilation-config key {key!r}; accepted: {', '.join(accepted)}")


# How the CLI spells build_engine_config's arguments, for its error messages.
FLAG_NAMES = {
    "model": "--model DIR",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "all2all_backend": "--all2all-backend",
    "enforce_eager": "--enforce-eager",
    "compilation_config": "compilation-config",
}


def engine_config_from_args(ns: argparse.Namespace, *,
                            default_hf_config: dict[str, Any] | None = None) -> EngineConfig:
    """Build and resolve an :class:`EngineConfig` from :func:`add_engine_args` arguments.

    A thin adapter over :func:`forwardkit.config.builder.build_engine_config` (same defaults
    as ``LLM(...)``): ``-O`` / ``-cc`` are parsed here, everything else is passed on.
    ``default_hf_config`` describes the model used when ``--model`` is absent; None = the
    built-in model (the config always has a ``ModelConfig``).
    """
    level, compilation = compilation_overrides_from_args(ns)
    chunked = getattr(ns, "enable_chunked_prefill", None)
    return build_engine_config(
        getattr(ns, "model", None),
        default_hf_config=default_hf_config,
        dtype=getattr(ns, "dtype", None),
        max_model_len=getattr(ns, "max_model_len", None),
        max_num_seqs=getattr(ns, "max_num_seqs", None),
        max_num_batched_tokens=getattr(ns, "max_num_batched_tokens", None),
        enable_chunked_prefill=True if chunked is None else chunked,
        enforce_eager=bool(getattr(ns, "enforce_eager", False)),
        compilation_config=compilation,
        optimization_level=level,
        block_size=getattr(ns, "block_size", None),
        platform=getattr(ns, "platform", None),
        arg_names=FLAG_NAMES,
        data_parallel_size=getattr(ns, "data_parallel_size", None),
        data_parallel_rank=getattr(ns, "data_parallel_rank", None),
        tensor_parallel_size=getattr(ns, "tensor_parallel_size", None),
        all2all_backend=getattr(ns, "all2all_backend", None),
        enable_expert_parallel=bool(getattr(ns, "enable_expert_parallel", False)),
        enable_dbo=bool(getattr(ns, "enable_dbo", False)),
        ubatch_size=getattr(ns, "ubatch_size", None),
        dbo_decode_token_threshold=getattr(ns, "dbo_decode_token_threshold", None),
        dbo_prefill_token_threshold=getattr(ns, "dbo_prefill_token_threshold", None),
    )
