"""Model registry: HF ``architectures`` name -> model class.

``get_model_class(["LlamaForCausalLM"])`` returns the class; an unknown architecture raises a
``ValueError`` listing the supported ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forwardkit.models.llama import LlamaForCausalLM

__all__ = ["get_model_class", "supported_architectures"]

# architecture -> (module, class); imported lazily so importing the registry stays cheap.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("forwardkit.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("forwardkit.models.mixtral", "MixtralForCausalLM"),
    # Qwen2 is Llama with biases on q/k/v (see ``llama.attention_biases``).
    "Qwen2ForCausalLM": ("forwardkit.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    """Architecture names ``get_model_class`` accepts."""
    return sorted(_MODELS)


def get_model_class(architectures: Sequence[str] | str | None) -> type[LlamaForCausalLM]:
    """The class of the first supported name in ``architectures`` (every registered class is
    ``LlamaForCausalLM`` or a subclass of it)."""
    if isinstance(architectures, str):
        architectures = [architectures]
    for arch in architectures or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"Model architectures {list(architectures or [])} are not supported; "
        f"supported architectures: {supported_architectures()}"
    )
