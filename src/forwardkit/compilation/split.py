"""Cut a Dynamo FX graph at the splitting ops (attention-like custom ops).

``split_graph`` follows the reference algorithm: every splitting op sits alone in an odd-numbered
piece (with its ``getitem`` users), everything between two splitting ops forms one compilable
piece, and ``split_module`` keeps the original node order so reads never move across in-place
mutations. Both ``OpOverload`` (``ns::op`` / ``ns::op.overload``) and ``OpOverloadPacket``
(``ns::op``, what ``torch.ops.ns.op(...)`` records) targets match.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

__all__ = ["SplitItem", "is_splitting_node", "split_graph"]


@dataclasses.dataclass
class SplitItem:
    """One piece of a split graph: its ``submod_<k>`` name, ``k``, and whether it is a splitting op."""

    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: torch.fx.GraphModule


def _op_names(target: object) -> tuple[str, ...]:
    """Qualified names a call target answers to (empty for non-op targets)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return (target._qualified_op_name,)
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name  # "ns::op"
        return (packet, f"{packet}.{target._overloadname}")
    return ()


def is_splitting_node(node: torch.fx.Node, ops: Sequence[str]) -> bool:
    """Whether ``node`` calls one of ``ops`` (``ns::op`` or ``ns::op.overload``)."""
    if node.op != "call_function":
        return False
    return any(name in ops for name in _op_names(node.target))


def split_graph(
    gm: torch.fx.GraphModule, ops: Sequence[str]
) -> tuple[torch.fx.GraphModule, list[SplitItem]]:
    """Split ``gm`` at ``ops``; returns the stitching module and its pieces in graph order."""
    for op in ops:
        if not isinstance(op, str) or "::" not in op:
            raise ValueError(f"splitting op {op!r} is not a 'namespace::op[.overload]' name")
    ops = list(ops)
    sid = 0
    ids: dict[torch.fx.Node, int] = {}
    splitting: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        # Tuples never cross piece boundaries: a getitem joins the piece of its source.
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].op != "placeholder"
        ):
            ids[node] = ids[node.args[0]]
            continue
        if is_splitting_node(node, ops):
            sid += 1
            ids[node] = sid
            splitting.add(sid)
            sid += 1
        else:
            ids[node] = sid
    # torch's stub says root_m: Module, but it is only read for get_attr nodes (vLLM passes None)
    split_gm = split_module(gm, None, lambda n: ids[n], keep_original_order=True)  # type: ignore[arg-type]
    items = []
    for name, module in split_gm.named_children():
        if not name.startswith("submod_"):
            continue
        k = int(name[len("submod_") :])
        if not isinstance(module, torch.fx.GraphModule):  # split_module makes GraphModules
            raise TypeError(f"split piece {name} is a {type(module).__name__}, not a GraphModule")
        items.append(SplitItem(name, k, k in splitting, module))
    items.sort(key=lambda it: it.graph_id)
    return split_gm, items
