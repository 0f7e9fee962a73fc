"""AOT save: fake inputs that are views of a persistent buffer are saved as plain tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from forwardkit.compilation.aot import _unviewed


def test_a_view_input_is_saved_as_a_plain_tensor_of_the_same_layout():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        buffer = torch.empty(64, 8)
        view = buffer[3:19]  # what the runner passes: a slice of its persistent input buffer
    assert view._is_view()
    with pytest.raises(Exception, match="pickle"):
        GraphPickler.dumps(view, Options(ops_filter=None))
    plain = _unviewed(view)
    assert not plain._is_view()
    assert (plain.shape, plain.stride(), plain.dtype, plain.device) == (
        view.shape, view.stride(), view.dtype, view.device)
    assert GraphPickler.dumps(plain, Options(ops_filter=None))  # now it can be saved
    assert _unviewed(buffer) is buffer  # not a view: unchanged
    assert _unviewed("stack trace") == "stack trace"  # other metadata: unchanged
