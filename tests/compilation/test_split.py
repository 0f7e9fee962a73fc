"""split_graph: where the graph is cut, and how many pieces come out."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from toy_model import ToyModel

from forwardkit.compilation.split import split_graph


def _dynamo_graph(model: torch.nn.Module, x: torch.Tensor):
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x)
    return captured[0]


@pytest.mark.parametrize("num_layers", [1, 3])
def test_n_attention_layers_give_2n_plus_1_pieces(num_layers):
    gm, inputs = _dynamo_graph(ToyModel(num_layers=num_layers), torch.randn(5, 32))
    split_gm, items = split_graph(gm, ["fktest::attn"])
    assert len(items) == 2 * num_layers + 1
    assert [it.is_splitting_graph for it in items] == [i % 2 == 1 for i in range(2 * num_layers + 1)]
    for it in items:
        attn_calls = [n for n in it.graph.graph.nodes if n.op == "call_function" and "attn" in str(n.target)]
        assert len(attn_calls) == (1 if it.is_splitting_graph else 0)
    torch.testing.assert_close(split_gm(*inputs), gm(*inputs))


def test_packet_and_overload_names_both_match():
    def f(x):
        out = torch.empty_like(x)
        torch.ops.fktest.attn(x, x, x, out, "a")  # packet target
        y = out * 2
        out2 = torch.empty_like(y)
        torch.ops.fktest.attn.default(y, y, y, out2, "b")  # overload target
        return out2 + 1

    gm = torch.fx.symbolic_trace(f)
    for ops in (["fktest::attn"], ["fktest::attn.default"]):
        _, items = split_graph(gm, ops)
        splitting = [it for it in items if it.is_splitting_graph]
        # the packet call only matches the bare name; the overload call matches both
        assert len(splitting) == (2 if ops == ["fktest::attn"] else 1)


def test_no_ops_means_one_piece_and_bad_names_are_rejected():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    _, items = split_graph(gm, [])
    assert [(it.submod_name, it.is_splitting_graph) for it in items] == [("submod_0", False)]
    with pytest.raises(ValueError, match="namespace::op"):
        split_graph(gm, ["attn"])


def test_leading_and_adjacent_splitting_ops_leave_gaps():
    def f(x):
        out = torch.empty_like(x)
        torch.ops.fktest.attn(x, x, x, out, "a")
        out2 = torch.empty_like(x)
        torch.ops.fktest.attn(out, out, out, out2, "b")
        return out2 + 1

    gm = torch.fx.symbolic_trace(f)
    _, items = split_graph(gm, ["fktest::attn"])
    names = [(it.submod_name, it.is_splitting_graph) for it in items]
    assert ("submod_1", True) in names and ("submod_3", True) in names
    assert all(it.graph_id % 2 == 1 for it in items if it.is_splitting_graph)
