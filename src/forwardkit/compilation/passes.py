"""Post-grad pass manager and the no-op elimination pass.

:class:`PostGradPassManager` is installed as Inductor's ``post_grad_custom_post_pass`` in the
backend's private copy of the Inductor config. It runs, in order: no-op elimination (when
``pass_config.eliminate_noops``), the CPU fusions of :mod:`forwardkit.compilation.fusion`
(when ``eliminate_noops`` is on too; they are exact rewrites), then the user's passes, then a
stable topological sort and dead-code elimination. Its ``uuid()`` covers the pass config, each
pass's source and the compile range, so Inductor's own caches never mix different pass sets.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx.experimental.symbolic_shapes import statically_known_true

from forwardkit.compilation.compiler import current_compile_range
from forwardkit.config.compilation_enums import Range
from forwardkit.logger import init_logger

__all__ = ["InductorPass", "NoOpEliminationPass", "PostGradPassManager"]

logger = init_logger(__name__)

aten = torch.ops.aten


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


def _shape(node: Any) -> tuple[Any, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _same_shape(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    return all(statically_known_true(x == y) for x, y in zip(a, b))


class NoOpEliminationPass(InductorPass):
    """Remove reshapes/slices that change nothing.

    (a) ``reshape(reshape(x))`` reads ``x`` directly; (b) a ``reshape``/``view`` or
    ``slice.Tensor`` whose output shape equals its input shape is dropped; (c) a
    ``slice_scatter(base, src, ...)`` whose ``src`` already has ``base``'s shape becomes ``src``.
    Symbolic dims compare with "statically known true", so ``s0 == s0`` but not ``s0 == s1``.
    """

    RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)

    def __call__(self, graph: torch.fx.Graph) -> None:
        removed = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in self.RESHAPES:
                src = node.args[0]
                if isinstance(src, torch.fx.Node) and src.target in self.RESHAPES:
                    node.update_arg(0, src.args[0])
                    if not src.users:
                        graph.erase_node(src)
                        removed += 1
                if _same_shape(_shape(node.args[0]), _shape(node)):
                    node.replace_all_uses_with(node.args[0])
                    graph.erase_node(node)
                    removed += 1
            elif node.target == aten.slice.Tensor:
                if _same_shape(_shape(node.args[0]), _shape(node)):
                    node.replace_all_uses_with(node.args[0])
                    graph.erase_node(node)
                    removed += 1
            elif node.target == aten.slice_scatter.default:
                base, src = node.args[0], node.args[1]
                if _same_shape(_shape(base), _shape(src)):
                    node.replace_all_uses_with(src)
                    graph.erase_node(node)
                    removed += 1
        logger.debug("no-op elimination removed %d nodes", removed)


class PostGradPassManager(InductorPass):
    """Runs forwardkit's post-grad passes chosen by ``PassConfig`` plus the user's passes."""

    def __init__(self, pass_config: Any = None, user_passes: Sequence[Any] = ()) -> None:
        from forwardkit.compilation.fusion import FusedAddRMSNormPass, SiluAndMulFusionPass

        self.pass_config = pass_config
        self.passes: list[Any] = []
        if pass_config is not None and getattr(pass_config, "eliminate_noops", False):
            self.passes.append(NoOpEliminationPass())
            self.passes.append(FusedAddRMSNormPass())
            self.passes.append(SiluAndMulFusionPass())
        self.passes.extend(user_passes)

    def add(self, user_pass: Any) -> None:
        """Append a user pass (a callable on ``torch.fx.Graph``, ideally with ``uuid()``)."""
        self.passes.append(user_pass)

    def __call__(self, graph: torch.fx.Graph) -> None:
        compile_range = current_compile_range()
        for p in self.passes:
            applicable = getattr(p, "is_applicable_for_range", None)
            if applicable is not None and not applicable(compile_range):
                logger.debug("skipping %s for range %s", type(p).__name__, compile_range)
                continue
            p(graph)
        graph.eliminate_dead_code()
        graph.lint()

    def uuid(self) -> str:
        """Pass config + each pass's uuid + the compile range."""

        def one(p: Any) -> str:
            fn = getattr(p, "uuid", None)
            return fn() if callable(fn) else hashlib.sha256(inspect.getsource(p).encode()).hexdigest()

        pc = self.pass_config
        state = {
            "pass_config": pc.compute_hash() if hasattr(pc, "compute_hash") else repr(pc),
            "passes": [one(p) for p in self.passes],
            "compile_range": str(current_compile_range()),
        }
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
