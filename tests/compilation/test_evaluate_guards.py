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


@pytest.mark.parametrize("mode", [2, 3])
def test_violation_keeps_torchs_guard_failure_text(make_config, mode):
    """vLLM lets torch's error through, and its tests (and code written against it) match
    torch's text; forwardkit's explanation comes first and torch's text follows unchanged."""
    cfg = make_config(mode=mode, backend="eager", splitting_ops=[],
                      dynamic_shapes_config={"evaluate_guards": True})
    model = Branchy(engine_config=cfg)
    model(torch.ones(8))
    with pytest.raises(RuntimeError) as info:
        model(torch.ones(3))
    text = str(info.value)
    assert isinstance(info.value, GuardViolationError)
    assert text.startswith("Branchy: this call breaks a shape guard")
    # vLLM's ported check: one of torch's two guard-failure wordings is in the message
    assert ("Detected recompile when torch.compile stance is 'fail_on_recompile'" in text
            or "GuardManager check failed" in text)
    assert text.endswith(str(info.value.__cause__))  # torch's whole text, unchanged
    assert "triggered by the following guard failure(s)" in text


def test_guards_dropped_by_default(make_config):
    model = Branchy(engine_config=make_config(mode=2, backend="eager", splitting_ops=[]))
    model(torch.ones(8))
    # vLLM's default: every guard is dropped, so the graph traced for s0 >= 4 runs for 2 too.
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))


@support_torch_compile
class ZeroOneBranches(torch.nn.Module):
    """Branches on sizes 0 and 1: traced at a size >= 2, Dynamo specialises them away."""

    def __init__(self, *, engine_config=None, prefix: str = "") -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 0:
            return x * 10
        if x.size(0) == 1:
            return x * 10
        return x * 10


@pytest.mark.parametrize("mode", [2, 3])
def test_backed_sizes_0_and_1_run_under_evaluated_guards(make_config, mode):
    """vLLM's rule for backed dynamic shapes with evaluate_guards: the implicit "size >= 2" of a
    backed symbol is not a guard, so a graph traced at 20 serves 1 (and 0 where the graph has
    a range for it: mode 2; mode 3's compile ranges start at 1, as in vLLM)."""
    cfg = make_config(mode=mode, backend="eager", splitting_ops=[],
                      dynamic_shapes_config={"type": "backed", "evaluate_guards": True})
    model = ZeroOneBranches(engine_config=cfg)
    x = torch.randn(20, 10)
    assert torch.equal(model(x), x * 10)
    sizes = [1, 5] if mode == 3 else [1, 0, 5]
    for n in sizes:
        y = torch.randn(n, 10)
        assert torch.equal(model(y), y * 10), n
    # the other kept guards still hold: Branchy's "s0 >= 4" is still refused below 4
    branchy = Branchy(engine_config=cfg)
    branchy(torch.ones(8))
    with pytest.raises(GuardViolationError, match="4 <= x.size"):
        branchy(torch.ones(2))


def test_size_oblivious_shapes_still_guard_size_1(make_config):
    """backed_size_oblivious reasons about 0/1 symbolically and keeps the guard: as in vLLM, size
    1 after a trace at 20 breaks it."""
    cfg = make_config(mode=3, backend="eager", splitting_ops=[],
                      dynamic_shapes_config={"type": "backed_size_oblivious",
                                             "evaluate_guards": True})
    model = ZeroOneBranches(engine_config=cfg)
    model(torch.randn(20, 10))
    with pytest.raises(GuardViolationError):
        model(torch.randn(1, 10))
