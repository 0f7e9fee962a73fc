"""Every ``FORWARDKIT_*`` environment variable, typed, in one place.

Values are read from ``os.environ`` on each attribute access (``envs.FORWARDKIT_CACHE_ROOT``),
so tests can ``monkeypatch.setenv`` and see the change. A malformed value raises a
``ValueError`` that names the variable, the bad value and what is accepted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["environment_variables", "is_set"]


def _cache_root() -> str:
    root = os.environ.get("FORWARDKIT_CACHE_ROOT")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(os.path.expanduser(xdg), "forwardkit")


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number; expected seconds as a float") from None

    return read


def _int(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None

    return read


def _bool(name: str, default: bool) -> Callable[[], bool]:
    truthy, falsy = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}

    def read() -> bool:
        raw = os.environ.get(name)
        if raw is None:
            return default
        value = raw.strip().lower()
        if value in truthy:
            return True
        if value in falsy:
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")

    return read


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        raw = os.environ.get(name, default)
        if raw not in choices:
            raise ValueError(f"Invalid value {raw!r} for {name}. Valid options: {list(choices)}")
        return raw

    return read


# name -> reader. Keep sorted by topic; DESIGN.md says this is the one place they live.
environment_variables: dict[str, Callable[[], Any]] = {
    # logging
    "FORWARDKIT_LOGGING_LEVEL": lambda: os.environ.get("FORWARDKIT_LOGGING_LEVEL", "INFO").upper(),
    # forward-context telemetry: seconds between batch-size timing summaries; < 0 disables.
    "FORWARDKIT_LOG_BATCHSIZE_INTERVAL": _float("FORWARDKIT_LOG_BATCHSIZE_INTERVAL", -1.0),
    # compile cache
    "FORWARDKIT_CACHE_ROOT": _cache_root,
    "FORWARDKIT_DISABLE_COMPILE_CACHE": _bool("FORWARDKIT_DISABLE_COMPILE_CACHE", False),
    "FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT": _choice(
        "FORWARDKIT_COMPILE_CACHE_SAVE_FORMAT", "binary", ("binary", "unpacked")
    ),
    "FORWARDKIT_DEBUG_DUMP_PATH": _str("FORWARDKIT_DEBUG_DUMP_PATH", None),
    # save/load Dynamo's result (mode 3, Inductor, cache on) so a warm start skips the trace
    "FORWARDKIT_USE_AOT_COMPILE": _bool("FORWARDKIT_USE_AOT_COMPILE", True),
    # deprecated: read once per engine config into compilation_config.custom_ops ("=0" is
    # "-cpu_linear", the one switch of the native linear kernels; config/custom_ops.py)
    "FORWARDKIT_CPU_NATIVE_LINEAR": _bool("FORWARDKIT_CPU_NATIVE_LINEAR", True),
    # deprecated: "=0" is read as "-cpu_attention" (the native decode attention's one switch)
    "FORWARDKIT_CPU_NATIVE_ATTENTION": _bool("FORWARDKIT_CPU_NATIVE_ATTENTION", True),
    # the CPU as forwardkit sees it, capped at an instruction set (platforms.cpu_capabilities):
    # "avx512" hides AMX (an AVX-512 server without it; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 for
    # oneDNN), "avx2" AVX-512 / AMX and native bf16 matmuls (an AVX2 server stand-in; pair it
    # with ONEDNN_MAX_CPU_ISA=AVX2 for oneDNN), "generic" every vector extension
    "FORWARDKIT_CPU_MAX_ISA": _choice("FORWARDKIT_CPU_MAX_ISA", "native",
                                      ("native", "avx512", "avx2", "generic")),
    # with AOT compile on: a missing or unusable saved entry is a FileNotFoundError instead of
    # a trace (vLLM: VLLM_FORCE_AOT_LOAD), for deployments that must never compile
    "FORWARDKIT_FORCE_AOT_LOAD": _bool("FORWARDKIT_FORCE_AOT_LOAD", False),
    # attention backend by registered name (vLLM: VLLM_ATTENTION_BACKEND); unset: TORCH_NATIVE
    "FORWARDKIT_ATTENTION_BACKEND": _str("FORWARDKIT_ATTENTION_BACKEND", None),
    # CUDA graphs
    "FORWARDKIT_ENABLE_CUDAGRAPH_GC": _bool("FORWARDKIT_ENABLE_CUDAGRAPH_GC", False),
    "FORWARDKIT_DBO_COMM_SMS": _int("FORWARDKIT_DBO_COMM_SMS", 20),
    # data parallel (offline SPMD launch, like vLLM's VLLM_DP_*)
    "FORWARDKIT_ALL2ALL_BACKEND": _str("FORWARDKIT_ALL2ALL_BACKEND", None),
    "FORWARDKIT_DP_SIZE": _int("FORWARDKIT_DP_SIZE", 1),
    "FORWARDKIT_DP_RANK": _int("FORWARDKIT_DP_RANK", 0),
    "FORWARDKIT_DP_RANK_LOCAL": lambda: _int(
        "FORWARDKIT_DP_RANK_LOCAL", environment_variables["FORWARDKIT_DP_RANK"]()
    )(),
    "FORWARDKIT_DP_MASTER_IP": _str("FORWARDKIT_DP_MASTER_IP", "127.0.0.1"),
    "FORWARDKIT_DP_MASTER_PORT": _int("FORWARDKIT_DP_MASTER_PORT", 0),
    # seconds every DP collective may take before the waiting ranks raise instead of hanging
    "FORWARDKIT_DP_TIMEOUT_S": _float("FORWARDKIT_DP_TIMEOUT_S", 120.0),
    # rows per DP rank that one MoE all-gather/reduce chunk carries (vLLM: VLLM_MOE_DP_CHUNK_SIZE)
    "FORWARDKIT_MOE_DP_CHUNK_SIZE": _int("FORWARDKIT_MOE_DP_CHUNK_SIZE", 256),
}


def is_set(name: str) -> bool:
    """Whether the variable is present in the environment (regardless of its value)."""
    if name not in environment_variables:
        raise AttributeError(f"unknown forwardkit environment variable {name!r}")
    return name in os.environ


def __getattr__(name: str) -> Any:
    reader = environment_variables.get(name)
    if reader is None:
        raise AttributeError(f"module 'forwardkit.envs' has no attribute {name!r}")
    return reader()


def __dir__() -> list[str]:
    return sorted([*environment_variables, *__all__])
