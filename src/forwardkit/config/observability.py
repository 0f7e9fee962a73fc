"""``ObservabilityConfig``: what the engine measures about itself (vLLM's field names)."""

from __future__ import annotations

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from forwardkit.config.frozen import FreezableConfig
from forwardkit.config.utils import hash_factors

__all__ = ["ObservabilityConfig"]


@dataclass(config=ConfigDict(extra="forbid"))
class ObservabilityConfig(FreezableConfig):
    """Per-step statistics the runner collects; none of them changes what is computed."""

    cudagraph_metrics: bool = False
    """Attach a ``CUDAGraphStat`` (unpadded / padded tokens, runtime mode) to every step plan."""

    def compute_hash(self) -> str:
        """Statistics never change the compiled graph: a constant (as in vLLM)."""
        return hash_factors({})
