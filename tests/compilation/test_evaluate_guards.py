"""``dynamic_shapes_config.evaluate_guards=True``: shape guards are kept and checked, so a call
that breaks one raises instead of silently running a graph specialised for other sizes."""

from __future__ import annotations

import pytest
import torch

from forwardkit.compilation.decorators import support_torch_compile
from forwardkit.compilation.wrapper import GuardViolationError


@support_torch_compile
class Branchy(torch.nn.Module):
    def __init__(self, *, engine_config=None, prefix: str = "") -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) >= 4:  # a shape guard: s0 >= 4
            return x * 2
        return x * 100


@pytest.mark.parametrize("mode", [2, 3])
def test_violated_shape_guard_raises(make_config, mode):
    cfg = make_config(mode=mode, backend="eager", splitting_ops=[],
                      dynamic_shapes_config={"evaluate_guards": True})
    model = Branchy(engine_config=cfg)
    assert torch.equal(model(torch.ones(8)), torch.full((8,), 2.0))
    assert torch.equal(model(torch.ones(5)), torch.full((5,), 2.0))  # guard holds: no retrace
    with pytest.raises(GuardViolationError, match=r"breaks a shape guard.*evaluate_guards=True.*4 <= x.size\(\)\[0\]"):
        model(torch.ones(2))


def test_guards_dropped_by_default(make_config):
    model = Branchy(engine_config=make_config(mode=2, backend="eager", splitting_ops=[]))
    model(torch.ones(8))
    # vLLM's default: every guard is dropped, so the graph traced for s0 >= 4 runs for 2 too.
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))
