"""The reference engine: ``LLM`` (offline generation) and ``SamplingParams``.

Modules: ``llm`` (the ``LLM`` front end and its step loop; its arguments become an
``EngineConfig`` through ``forwardkit.config.builder``), ``scheduler`` (continuous batching, chunked prefill),
``block_manager`` (KV blocks with automatic prefix caching; ``block_hash``), ``metrics``
(``LLM.get_metrics``), ``sampler``, ``sampling_params``, ``request``,
``outputs``, ``tokenizer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forwardkit.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from forwardkit.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from forwardkit.engine.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestMetrics", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # NOTE: LLM pulls in the runner, models and torch.compile machinery; import it on demand
    # so ``from forwardkit.engine import SamplingParams`` stays light.
    if name == "LLM":
        from forwardkit.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'forwardkit.engine' has no attribute {name!r}")
