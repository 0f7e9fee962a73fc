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
        # metadata class -> its field names, checked to be a dataclass once (not per step)
        self._fields: dict[type, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self._by_size)

    def _field_names(self, cls: type) -> tuple[str, ...]:
        names = self._fields.get(cls)
        if names is None:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"FULL-graph attention metadata must be a dataclass (its tensor "
                                f"fields are refilled in place), got {cls.__name__}")
            names = self._fields[cls] = tuple(f.name for f in dataclasses.fields(cls))
        return names

    def update(self, num_tokens: Hashable, metadata: StepAttentionMetadata) -> StepAttentionMetadata:
        """Return the persistent metadata for key ``num_tokens`` holding ``metadata``'s values."""
        names = self._field_names(type(metadata))
        kept = self._by_size.get(num_tokens)
        if kept is None:
            self._by_size[num_tokens] = metadata
            return metadata
        if type(kept) is not type(metadata):
            raise TypeError(f"FULL-graph attention metadata at {num_tokens} tokens changed type "
                            f"{type(kept).__name__} -> {type(metadata).__name__}")
        for name in names:
            new = getattr(metadata, name)
            if isinstance(new, torch.Tensor):
                old = getattr(kept, name)
                if new.shape != old.shape:
                    raise RuntimeError(
                        f"FULL-graph attention metadata field {name!r} changed shape "
                        f"{tuple(old.shape)} -> {tuple(new.shape)} at {num_tokens} tokens"
                    )
                old.copy_(new, non_blocking=True)
            else:
                setattr(kept, name, new)
        return kept
