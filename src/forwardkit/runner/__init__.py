"""Execution layer: ``ModelRunner`` runs one forward step of a ``StepBatch``.

Modules: ``model_runner`` (the step: padding, DP agreement, metadata, forward context,
logits; dummy runs and graph capture), ``batch`` (``StepBatch``, the scheduler -> runner
hand-off), ``input_buffers`` (static token/position tensors), ``setup`` (KV-cache size,
CUDA-graph mode resolution), ``static_metadata`` (persistent metadata for FULL graphs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forwardkit.runner.batch import StepBatch

if TYPE_CHECKING:
    from forwardkit.runner.model_runner import ModelRunner

__all__ = ["ModelRunner", "StepBatch"]


def __getattr__(name: str) -> Any:
    if name == "ModelRunner":
        from forwardkit.runner.model_runner import ModelRunner

        return ModelRunner
    raise AttributeError(f"module 'forwardkit.runner' has no attribute {name!r}")
