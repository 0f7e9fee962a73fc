"""vLLM-style engine arguments, shared by ``forwardkit config``, ``generate`` and ``bench``.

``forwardkit.commands.engine_flags.add_engine_args(parser)`` adds the flags (without importing
torch, so ``forwardkit --help`` is quick); ``engine_config_from_args(ns)`` here turns the parsed
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
from typing import Any

from forwardkit.config.builder import build_engine_config, one_line_error
from forwardkit.config.compilation import CompilationConfig, CompilationMode
from forwardkit.config.engine import EngineConfig, OptimizationLevel
from forwardkit.config.utils import short_repr

__all__ = [
    "FLAG_NAMES",
    "compilation_overrides_from_args",
    "engine_config_from_args",
    "one_line_error",
]

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
    mode = config.get("mode")
    if isinstance(mode, str) and re.fullmatch(r"[0-9]+", mode.strip()):
        config["mode"] = int(mode)  # "3" as -O.mode=3 takes it
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
    "quantization": "--quantization",
    "enable_prefix_caching": "--enable-prefix-caching",
    "prefix_caching_hash_algo": "--prefix-caching-hash-algo",
    "speculative_config": "--speculative-config",
    "enable_lora": "--enable-lora",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
    "max_cpu_loras": "--max-cpu-loras",
}


def _lora_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The LoRA engine arguments of ``--enable-lora`` / ``--lora`` / ``--max-loras`` ...:
    ``--lora`` implies ``--enable-lora``, and ``--max-loras`` defaults to the adapter count."""
    loras = getattr(ns, "loras", None) or []
    enable = bool(getattr(ns, "enable_lora", False)) or bool(loras)
    out: dict[str, Any] = {"enable_lora": enable}
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(ns, name, None)
        if value is not None:
            out[name] = value
    if loras and "max_loras" not in out:
        out["max_loras"] = len(loras)
    return out


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
        enable_prefix_caching=getattr(ns, "enable_prefix_caching", None),
        prefix_caching_hash_algo=getattr(ns, "prefix_caching_hash_algo", None),
        speculative_config=getattr(ns, "speculative_config", None),
        **_lora_args(ns),
        platform=getattr(ns, "platform", None),
        arg_names=FLAG_NAMES,
        quantization=getattr(ns, "quantization", None),
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
