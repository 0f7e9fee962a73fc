"""forwardkit: the model-execution layer of an LLM inference engine.

Forward context, data-parallel coordination, the compilation config, piecewise
``torch.compile`` with an on-disk cache, and a small reference engine, re-implementing
what vLLM 0.14.0 documents as ``vllm.forward_context`` and ``vllm.config.CompilationConfig``.

The common names are importable from here (``from forwardkit import LLM, SamplingParams``)
and are loaded on first access, so ``import forwardkit`` itself imports neither torch nor
anything else heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it, imported on first attribute access. The package is a
# facade over every layer, so these are strings, not imports (the layering rule still holds).
_LAZY: dict[str, str] = {
    "LLM": "forwardkit.engine.llm",
    "LoRARequest": "forwardkit.engine.lora",
    "SamplingParams": "forwardkit.engine.sampling_params",
    "RequestOutput": "forwardkit.engine.outputs",
    "CompletionOutput": "forwardkit.engine.outputs",
    "Logprob": "forwardkit.engine.logprobs",
    "EngineConfig": "forwardkit.config.engine",
    "CompilationConfig": "forwardkit.config.compilation",
    "CompilationMode": "forwardkit.config.compilation_enums",
    "CUDAGraphMode": "forwardkit.config.compilation_enums",
    "ForwardContext": "forwardkit.forward_context",
    "BatchDescriptor": "forwardkit.forward_context",
    "set_forward_context": "forwardkit.forward_context",
    "get_forward_context": "forwardkit.forward_context",
    "override_forward_context": "forwardkit.forward_context",
    "create_forward_context": "forwardkit.forward_context",
    "is_forward_context_available": "forwardkit.forward_context",
}

__all__ = [
    "BatchDescriptor", "CUDAGraphMode", "CompilationConfig", "CompilationMode", "CompletionOutput",
    "EngineConfig", "ForwardContext", "LLM", "Logprob", "LoRARequest", "RequestOutput", "SamplingParams",
    "__version__", "create_forward_context", "get_forward_context", "is_forward_context_available",
    "override_forward_context", "set_forward_context",
]

def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'forwardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
