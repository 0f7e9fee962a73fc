"""Which attention backend an engine config selects, and how much of a batch it can run inside
a full CUDA graph: the two facts resolution needs to decide the graph mode the runner serves.

The backends themselves (kernels, metadata builders) live in ``layers/attention_backend.py``
and register into :data:`ATTENTION_BACKENDS` here (``register_attention_backend``), so the
config layer reads a backend's ``cudagraph_support`` without importing the model layer. The
selection rule is vLLM's: a name given to the config, else ``FORWARDKIT_ATTENTION_BACKEND``
(vLLM: ``VLLM_ATTENTION_BACKEND``), else ``TORCH_NATIVE``.
"""

from __future__ import annotations

import enum
from typing import Any

from forwardkit import envs

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_ATTENTION_BACKEND",
    "AttentionCGSupport",
    "attention_cudagraph_support",
    "selected_attention_backend",
]


class AttentionCGSupport(enum.IntEnum):
    """How much of a batch an attention backend can run inside a full CUDA graph."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


# name -> backend class (an ``AttentionBackend`` subclass of the model layer); filled by
# ``forwardkit.layers.attention_backend.register_attention_backend``.
ATTENTION_BACKENDS: dict[str, Any] = {}
DEFAULT_ATTENTION_BACKEND = "TORCH_NATIVE"


def selected_attention_backend(name: str | None = None) -> str:
    """The backend name a config selects: ``name``, else ``FORWARDKIT_ATTENTION_BACKEND``, else
    ``TORCH_NATIVE``. Not checked against the registry (backends may register later)."""
    if name is None:
        name = envs.FORWARDKIT_ATTENTION_BACKEND or DEFAULT_ATTENTION_BACKEND
    return name


def attention_cudagraph_support(name: str) -> AttentionCGSupport:
    """The ``cudagraph_support`` of the registered backend ``name``; a ``ValueError`` naming the
    registered ones when it is not registered (yet)."""
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise ValueError(
            f"attention backend {name!r} is not registered (registered: "
            f"{sorted(ATTENTION_BACKENDS)}); its CUDA-graph support decides the graph mode, so "
            "import the module that registers it (forwardkit.layers.attention_backend for the "
            "built-in ones) before reading the served graph mode"
        )
    return AttentionCGSupport(backend.cudagraph_support)
