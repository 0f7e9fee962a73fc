"""The sequence-parallelism pass (``PassConfig.enable_sp``): all-reduce + RMSNorm becomes
reduce-scatter + RMSNorm on this rank's rows + all-gather.

A tensor-parallel decoder sums the row-parallel outputs over TP (``forwardkit::all_reduce``)
and then normalises every row on every rank. Both can be split by rows instead: a
reduce-scatter gives each rank the sum for its ``1/tp`` of the rows, the (residual-add +)
RMSNorm runs on those rows only, and an all-gather of the normalised rows gives the next
projection its full input. The residual stream stays scattered from one norm to the next, so
the adds and norms cost ``1/tp`` and the bytes moved are those of the all-reduce.

The rewrite works on the whole Dynamo graph, before the graph is split at the attention ops, so
every piece is compiled for the shapes it really sees (the scattered residual that crosses a
piece boundary is an input of ``rows / tp`` rows); vLLM rewrites each piece after the split,
where a piece's declared residual shape no longer matches (its issue 25277). The token count is
a multiple of TP at every step (the runner pads to one when ``enable_sp`` is on), so the
rewrite holds for every compile range and size.

Patterns, in graph order (``ar`` = ``forwardkit::all_reduce(x, "tp")``):

* first: ``rms_norm(ar)`` -> ``all_gather(rms_norm(reduce_scatter(x)))``; the other users of
  ``ar`` (the residual of the next norm) take the scattered ``reduce_scatter(x)``;
* middle: ``fused_add_rms_norm(ar, residual)`` -> ``fused_add_rms_norm(reduce_scatter(x),
  residual rows)``, its normalised output all-gathered, its new residual kept scattered.

A norm with one scattered input takes this rank's rows of the other (a local slice, no
communication). A scattered value used by anything but a norm is all-gathered for that use,
so models the patterns do not fit (an MoE block that gathers itself) stay correct.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

import forwardkit.distributed.communication_op  # noqa: F401 - registers the collective ops
from forwardkit.logger import init_logger

__all__ = ["SequenceParallelismPass"]

logger = init_logger(__name__)

_ops = torch.ops.forwardkit


def _is(node: Any, name: str) -> bool:
    """Whether ``node`` calls ``forwardkit::<name>`` (the norms are registered by the model's
    layers; a graph without them has no such calls)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    packet = getattr(_ops, name, None) if hasattr(_ops, name) else None
    if packet is None:
        return False
    target = node.target
    return target is packet or getattr(target, "overloadpacket", None) is packet


def _arg(node: torch.fx.Node, index: int, name: str) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


class SequenceParallelismPass:
    """Rewrites a Dynamo graph of a TP-``tp_size`` model on TP rank ``tp_rank`` (module
    docstring). Calling it returns the number of all-reduces turned into reduce-scatters.

    The rewrite is in place: a converted all-reduce node becomes a reduce-scatter, and the
    norms (and the ``getitem`` outputs of the fused norm) downstream of it compute on this
    rank's rows without being replaced. Afterwards every scattered node's other users get one
    all-gather of it (``forwardkit::sp_all_gather``, which keeps the full row count
    symbolic).
    """

    def __init__(self, tp_size: int, tp_rank: int, group_name: str = "tp") -> None:
        if tp_size < 2:
            raise ValueError(f"the sequence-parallelism pass needs tensor_parallel_size >= 2, "
                             f"got {tp_size}")
        self.tp_size, self.tp_rank, self.group = tp_size, tp_rank, group_name

    def _norm_users_only(self, node: torch.fx.Node) -> bool:
        return bool(node.users) and all(
            (_is(u, "rms_norm") and _arg(u, 0, "x") is node) or _is(u, "fused_add_rms_norm")
            for u in node.users)

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        graph = gm.graph
        rows_of: dict[torch.fx.Node, torch.fx.Node] = {}  # scattered node -> full row count
        norms: set[torch.fx.Node] = set()  # norms (and their outputs) that take scattered rows
        converted = 0
        for node in list(graph.nodes):
            if (_is(node, "all_reduce") and _arg(node, 1, "group_name") == self.group
                    and self._norm_users_only(node)):
                x = node.args[0]
                with graph.inserting_before(node):
                    rows_of[node] = graph.call_function(torch.ops.aten.sym_size.int, (x, 0))
                node.target = _ops.reduce_scatter.default
                node.args, node.kwargs = (x, 0, self.tp_size, self.group), {}
                converted += 1
            elif _is(node, "rms_norm") and _arg(node, 0, "x") in rows_of:
                rows_of[node] = rows_of[_arg(node, 0, "x")]
                norms.add(node)
            elif _is(node, "fused_add_rms_norm"):
                inputs = [_arg(node, 0, "x"), _arg(node, 1, "residual")]
                local = [v for v in inputs if v in rows_of]
                if not local:
                    continue
                for value in inputs:
                    if value not in rows_of:  # this rank's rows of a full tensor: no comm
                        with graph.inserting_before(node):
                            part = graph.call_function(_ops.sp_slice.default,
                                                       (value, self.tp_size, self.tp_rank))
                        node.replace_input_with(value, part)
                norms.add(node)
                for user in node.users:
                    if user.op == "call_function" and user.target is operator.getitem:
                        rows_of[user] = rows_of[local[0]]
                        norms.add(user)
                    else:
                        raise RuntimeError(f"sequence parallelism: {node} is used whole by "
                                           f"{user}; expected only its two outputs")
        for node, rows in rows_of.items():
            others = [u for u in node.users if u not in norms]
            if not others:
                continue
            with graph.inserting_after(node):
                full = graph.call_function(_ops.sp_all_gather.default,
                                           (node, rows, self.tp_size, self.group))
            for user in others:
                user.replace_input_with(node, full)
        graph.lint()
        gm.recompile()
        if converted:
            logger.info_once("sequence parallelism: %d all-reduces became reduce-scatter + "
                             "all-gather around the RMSNorms (TP %d)", converted, self.tp_size)
        return converted
