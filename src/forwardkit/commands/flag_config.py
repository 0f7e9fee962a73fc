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
    "EngineFlags",
    "compilation_overrides",
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
    return compilation_overrides(EngineFlags.from_namespace(ns))


def compilation_overrides(flags: EngineFlags) -> tuple[int | None, dict[str, Any]]:
    """(optimisation level or None, compilation-config dict) from the ``-O`` / ``-cc`` flags."""
    level: int | None = None
    config: dict[str, Any] = {}
    raw = flags.compilation_config
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
    for item in flags.engine_O or []:
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


@dataclasses.dataclass(frozen=True)
class EngineFlags:
    """The engine flags of :func:`~forwardkit.commands.engine_flags.add_engine_args`, typed.

    Built from a parsed namespace by :meth:`from_namespace`; a flag the namespace lacks (a
    subcommand or a caller that builds its own namespace without it) keeps the default here,
    which is the flag's own default."""

    model: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str | None = None
    speculative_config: dict[str, Any] | None = None
    quantization: str | None = None
    data_parallel_size: int | None = None
    data_parallel_rank: int | None = None
    tensor_parallel_size: int | None = None
    enable_expert_parallel: bool = False
    all2all_backend: str | None = None
    enable_dbo: bool = False
    ubatch_size: int | None = None
    dbo_decode_token_threshold: int | None = None
    dbo_prefill_token_threshold: int | None = None
    enforce_eager: bool = False
    platform: str | None = None
    engine_O: list[str] | None = None
    compilation_config: str | None = None
    enable_lora: bool = False
    loras: list[tuple[str, str]] | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineFlags:
        """The engine flags ``ns`` carries (other attributes, the subcommand's own, are left)."""
        given = vars(ns)
        return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})


def _lora_args(flags: EngineFlags) -> dict[str, Any]:
    """The LoRA engine arguments of ``--enable-lora`` / ``--lora`` / ``--max-loras`` ...:
    ``--lora`` implies ``--enable-lora``, and ``--max-loras`` defaults to the adapter count."""
    loras = flags.loras or []
    out: dict[str, Any] = {"enable_lora": bool(flags.enable_lora) or bool(loras)}
    for name, value in (("max_loras", flags.max_loras), ("max_lora_rank", flags.max_lora_rank),
                        ("max_cpu_loras", flags.max_cpu_loras)):
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
    flags = EngineFlags.from_namespace(ns)
    level, compilation = compilation_overrides(flags)
    return build_engine_config(
        flags.model,
        default_hf_config=default_hf_config,
        dtype=flags.dtype,
        max_model_len=flags.max_model_len,
        max_num_seqs=flags.max_num_seqs,
        max_num_batched_tokens=flags.max_num_batched_tokens,
        enable_chunked_prefill=True if flags.enable_chunked_prefill is None else flags.enable_chunked_prefill,
        enforce_eager=bool(flags.enforce_eager),
        compilation_config=compilation,
        optimization_level=level,
        block_size=flags.block_size,
        enable_prefix_caching=flags.enable_prefix_caching,
        prefix_caching_hash_algo=flags.prefix_caching_hash_algo,
        speculative_config=flags.speculative_config,
        **_lora_args(flags),
        platform=flags.platform,
        arg_names=FLAG_NAMES,
        quantization=flags.quantization,
        data_parallel_size=flags.data_parallel_size,
        data_parallel_rank=flags.data_parallel_rank,
        tensor_parallel_size=flags.tensor_parallel_size,
        all2all_backend=flags.all2all_backend,
        enable_expert_parallel=bool(flags.enable_expert_parallel),
        enable_dbo=bool(flags.enable_dbo),
        ubatch_size=flags.ubatch_size,
        dbo_decode_token_threshold=flags.dbo_decode_token_threshold,
        dbo_prefill_token_threshold=flags.dbo_prefill_token_threshold,
    )
