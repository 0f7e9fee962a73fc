"""Persistent attention metadata for steps that replay a FULL CUDA graph.

A FULL graph bakes in the device addresses of every tensor it reads, attention metadata
included. So for each padded size the first metadata seen (the capture run's) is kept, and
later steps of that size copy their values into it instead of handing over new tensors.
Shapes must then be fixed per size: the runner builds FULL-mode metadata with every padding
row as a dummy one-token request on the scratch block and a fixed block-table width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import torch

from forwardkit.forward_context import StepAttentionMetadata

__all__ = ["StaticMetadataPool"]


class StaticMetadataPool:
    """Per key (a padded token count; for a micro-batched graph (padded count, micro-batch
    index)), one metadata object whose tensors never move."""

    def __init__(self) -> None:
        self._by_size: dict[Hashable, StepAttentionMetadata] = {}

    def __len__(self) -> int:
        return len(self._by_size)

    def update(self, num_tokens: Hashable, metadata: StepAttentionMetadata) -> StepAttentionMetadata:
        """Return the persistent metadata for key ``num_tokens`` holding ``metadata``'s values."""
        if not dataclasses.is_dataclass(metadata):
            raise TypeError(f"FULL-graph attention metadata must be a dataclass (its tensor "
                            f"fields are refilled in place), got {type(metadata).__name__}")
        kept = self._by_size.get(num_tokens)
        if kept is None:
            self._by_size[num_tokens] = metadata
            return metadata
        for f in dataclasses.fields(metadata):
            new = getattr(metadata, f.name)
            old = getattr(kept, f.name)
            if isinstance(new, torch.Tensor):
                if new.shape != old.shape:
                    raise RuntimeError(
                        f"FULL-graph attention metadata field {f.name!r} changed shape "
                        f"{tuple(old.shape)} -> {tuple(new.shape)} at {num_tokens} tokens"
                    )
                old.copy_(new, non_blocking=True)
            else:
                setattr(kept, f.name, new)
        return kept
