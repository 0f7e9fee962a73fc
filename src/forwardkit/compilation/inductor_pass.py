"""``InductorPass``: the base class of forwardkit's post-grad passes and of user passes.

Kept in its own module so that the pass manager (:mod:`forwardkit.compilation.passes`) and the
passes themselves (:mod:`forwardkit.compilation.fusion`, user code) import it without importing
each other. ``forwardkit.compilation.passes.InductorPass`` still names the same class.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from forwardkit.config.compilation_enums import Range

__all__ = ["InductorPass"]


class InductorPass(CustomGraphPass):
    """Base pass: ``uuid()`` hashes the class source; applies to every range by default."""

    def __call__(self, graph: torch.fx.Graph) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def uuid(self) -> str:
        """Identity for Inductor's caches: the pass class's source text."""
        return hashlib.sha256(inspect.getsource(type(self)).encode()).hexdigest()

    def is_applicable_for_range(self, compile_range: Range | None) -> bool:
        """Whether to run for the range being compiled (all ranges by default)."""
        return True

    @staticmethod
    def hash_source(*items: Any) -> str:
        """SHA-256 over the items for a ``uuid()``: strings as they are, functions and classes
        by their source text, other objects by their class's source text."""
        h = hashlib.sha256()
        for item in items:
            if not isinstance(item, str):
                target = item if inspect.isfunction(item) or inspect.isclass(item) else type(item)
                item = inspect.getsource(target)
            h.update(item.encode("utf-8"))
        return h.hexdigest()

    @staticmethod
    def hash_dict(d: dict[str, Any]) -> str:
        """SHA-256 of ``d`` as JSON with sorted keys (for a ``uuid()`` over pass settings)."""
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode("utf-8")).hexdigest()
