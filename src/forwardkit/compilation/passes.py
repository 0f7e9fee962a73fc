"""Post-grad pass manager and the no-op elimination pass.

:class:`PostGradPassManager` is installed as Inductor's ``post_grad_custom_post_pass`` in the
backend's private copy of the Inductor config. It runs, in order: no-op elimination (when
``pass_config.eliminate_noops``), the passes a lower layer registered in
:data:`~forwardkit.compilation.pass_registry.FLAG_PASSES`
(the quantized-weight fusions behind ``fuse_norm_quant`` / ``fuse_act_quant``, which live beside
the kernels they feed, ``quantization/fusion.py``), the fusions of
:mod:`forwardkit.compilation.fusion` (each behind its own flag, ``pass_config.fuse_rms_norm`` and
``pass_config.fuse_silu_and_mul``; they are exact rewrites), then the user's passes, then
dead-code elimination. Its ``uuid()``
covers the pass config, each pass's source and the compile range, so Inductor's own caches never mix different pass sets.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from forwardkit.compilation.compiler import current_compile_range
from forwardkit.compilation.fusion import FusedAddRMSNormPass, SiluAndMulFusionPass
from forwardkit.compilation.inductor_pass import InductorPass
from forwardkit.compilation.pass_registry import FLAG_PASSES, register_flag_pass
from forwardkit.logger import init_logger

if TYPE_CHECKING:
    from forwardkit.config.pass_config import PassConfig

__all__ = ["FLAG_PASSES", "InductorPass", "NoOpEliminationPass", "PostGradPassManager",
           "register_flag_pass"]

logger = init_logger(__name__)

aten = torch.ops.aten

# A post-grad pass: a callable on the graph; ``uuid()`` and ``is_applicable_for_range(range)``
# are optional for a user's pass (looked up by name), an InductorPass has both.
GraphPass = Callable[[torch.fx.Graph], object]
Shape = tuple[int | torch.SymInt, ...]


def _shape(node: object) -> Shape | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _same_shape(a: Shape | None, b: Shape | None) -> bool:
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

    def __init__(self, pass_config: PassConfig | None = None, user_passes: Sequence[GraphPass] = ()) -> None:
        self.pass_config = pass_config
        self.passes: list[GraphPass] = []
        if pass_config is not None:
            if pass_config.eliminate_noops:
                self.passes.append(NoOpEliminationPass())
            for name in sorted(FLAG_PASSES):
                made = FLAG_PASSES[name](pass_config)
                if made is not None:
                    self.passes.append(made)
            if pass_config.fuse_rms_norm:
                self.passes.append(FusedAddRMSNormPass())
            if pass_config.fuse_silu_and_mul:
                self.passes.append(SiluAndMulFusionPass())
        self.passes.extend(user_passes)

    def add(self, user_pass: GraphPass) -> None:
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

        def one(p: GraphPass) -> str:
            fn = getattr(p, "uuid", None)
            return fn() if callable(fn) else hashlib.sha256(inspect.getsource(p).encode()).hexdigest()

        pc = self.pass_config
        state = {
            "pass_config": pc.compute_hash() if pc is not None else "None",
            "passes": [one(p) for p in self.passes],
            "compile_range": str(current_compile_range()),
        }
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
