"""CPU fusions: let Inductor fuse residual-add + RMSNorm and SiLU-and-mul into one kernel each.

With ``custom_ops`` enabled (``+rms_norm``, ``+silu_and_mul``, or ``all``), the model emits
opaque ``forwardkit::fused_add_rms_norm`` / ``forwardkit::rms_norm`` / ``forwardkit::silu_and_mul``
calls. Inside a compiled piece Inductor cannot fuse through them: each runs as several eager
ATen kernels with full-size intermediates. On CPU there are no hand-written kernels behind these
ops, so the fusion that pays off is to replace each call by the op's own Python implementation,
traced to ATen in place; Inductor then emits one C++ kernel for add + reduction + normalise +
scale (and one for SiLU * up), fused with neighbouring pointwise work.

The replacement is exact (it is the op's own implementation). A pass never fires on a graph that
does not call its ops (e.g. the native forms that ``custom_ops=["none"]`` produces, which Inductor
already fuses), and when an op is not registered in this process it is skipped with a warning.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import cast

import torch
import torch.fx
from torch._ops import OpOverload
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import Argument

from forwardkit.compilation.inductor_pass import InductorPass
from forwardkit.logger import init_logger

__all__ = ["FusedAddRMSNormPass", "InlineOpaqueOpPass", "SiluAndMulFusionPass"]

logger = init_logger(__name__)


def _op_impl(qualname: str) -> tuple[OpOverload, Callable[..., object]] | None:
    """(OpOverload, Python implementation) of a ``torch.library.custom_op``, or None if absent."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(qualname)
    if opdef is None:
        return None
    return opdef._opoverload, opdef._init_fn


class InlineOpaqueOpPass(InductorPass):
    """Replace calls to the given functional custom ops by their traced Python implementation."""

    OPS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.fired = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        impls: dict[OpOverload, Callable[..., object]] = {}
        for name in self.OPS:
            found = _op_impl(name)
            if found is None:
                logger.debug_once("%s: op %s is not registered; skipping it", type(self).__name__, name)
                continue
            impls[found[0]] = found[1]
        if not impls:
            return
        for node in list(graph.nodes):
            target = node.target
            if node.op == "call_function" and isinstance(target, OpOverload) and target in impls:
                self._inline(graph, node, target, impls[target])
                self.fired += 1

    @staticmethod
    def _inline(graph: torch.fx.Graph, node: torch.fx.Node, op: OpOverload,
                impl: Callable[..., object]) -> None:
        """Replace ``node`` (a call of ``op``) by ``impl`` traced on the node's fake inputs."""
        schema = op._schema
        args: list[Argument] = list(node.args) + [
            node.kwargs[a.name] for a in schema.arguments[len(node.args):] if a.name in node.kwargs
        ]
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.fx.Node)]
        inputs = [a for a in args if isinstance(a, torch.fx.Node)]  # the args at tensor_pos
        fakes = [a.meta["val"] for a in inputs]

        def body(*tensors: torch.Tensor) -> object:
            full = list(args)
            for i, t in zip(tensor_pos, tensors):
                full[i] = t
            return impl(*full)

        fake_mode = torch._guards.detect_fake_mode(fakes)
        if fake_mode is None:  # a post-grad graph always carries fake values; be explicit
            raise RuntimeError(f"{node.target}: no fake tensor mode on the node's inputs")
        from torch._inductor.decomposition import select_decomp_table

        with fake_mode:
            sub = make_fx(body, decomposition_table=select_decomp_table())(*fakes)
        val_map = dict(zip(sub.graph.find_nodes(op="placeholder"), inputs))
        with graph.inserting_before(node):
            out = graph.graph_copy(sub.graph, val_map)
        # the copied graph's output: one node, or a tuple/list of nodes
        if isinstance(out, (tuple, list)):
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    user.replace_all_uses_with(cast(torch.fx.Node, out[cast(int, user.args[1])]))
                    graph.erase_node(user)
        else:
            node.replace_all_uses_with(cast(torch.fx.Node, out))
        if not node.users:
            graph.erase_node(node)


class FusedAddRMSNormPass(InlineOpaqueOpPass):
    """Residual-add + RMSNorm (``forwardkit::fused_add_rms_norm`` / ``rms_norm``) as one kernel."""

    OPS = ("forwardkit::fused_add_rms_norm", "forwardkit::rms_norm")


class SiluAndMulFusionPass(InlineOpaqueOpPass):
    """SiLU-and-mul (``forwardkit::silu_and_mul``) fused with its neighbours."""

    OPS = ("forwardkit::silu_and_mul",)
