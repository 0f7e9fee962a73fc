"""support_torch_compile: modes 0-3 on the toy model, one trace across token counts, bypasses."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from toy_model import CompiledToyModel, ToyModel

from forwardkit.compilation.counters import compilation_counter
from forwardkit.compilation.decorators import ignore_torch_compile, support_torch_compile
from forwardkit.config.engine import set_current_engine_config

TOKENS = [1, 3, 17, 64]  # a first call with 1 token marks the dim unbacked


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_modes_match_eager(make_config, mode):
    cfg = make_config(mode=mode, backend="eager")
    model, ref = CompiledToyModel(engine_config=cfg), ToyModel()
    before = compilation_counter.clone()
    for n in TOKENS:
        x = torch.randn(n, 32)
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    traces = compilation_counter.num_dynamo_traces - before.num_dynamo_traces
    if mode in (2, 3):
        assert traces == 1
        assert compilation_counter.num_recompiles == before.num_recompiles
    if mode == 0:
        assert traces == 0 and model._fk_compiler is None
    if mode == 3:
        assert compilation_counter.num_graphs_seen - before.num_graphs_seen == 1


@pytest.mark.parametrize("mode", [2, 3])
def test_trace_once_with_inductor(make_config, mode):
    """The real backend: still one trace for 1, 3, 17 and 64 tokens; numerics close to eager."""
    cfg = make_config(mode=mode, backend="inductor", compile_ranges_split_points=[2048])
    model, ref = CompiledToyModel(engine_config=cfg, num_layers=1, hidden=16), ToyModel(num_layers=1, hidden=16)
    with compilation_counter.expect(num_dynamo_traces=1, num_recompiles=0):
        for n in reversed(TOKENS):
            x = torch.randn(n, 16)
            torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


def test_enforce_eager_and_ignore_bypass(make_config):
    from forwardkit.config.frozen import unfrozen
    from forwardkit.config.model import ModelConfig

    cfg = make_config(mode=3)
    with unfrozen(cfg):  # mode 3 kept with an eager model: the decorator must still bypass
        cfg.model_config = ModelConfig(enforce_eager=True)
    with compilation_counter.expect(num_models_seen=0, num_dynamo_traces=0):
        model = CompiledToyModel(engine_config=cfg)
        model(torch.randn(4, 32))

    @ignore_torch_compile
    class Eager(CompiledToyModel):
        pass

    with compilation_counter.expect(num_models_seen=0, num_dynamo_traces=0):
        Eager(engine_config=make_config(mode=3))(torch.randn(4, 32))


def test_user_module_one_line_and_current_config(make_config):
    @support_torch_compile
    class Mine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
            return torch.relu(self.lin(x)) * scale

    with set_current_engine_config(make_config(mode=2, splitting_ops=[])):
        m = Mine()
    with compilation_counter.expect(num_models_seen=0, num_dynamo_traces=1):
        for n in (5, 2, 9, 1):
            x = torch.randn(n, 8)
            torch.testing.assert_close(m(x), torch.relu(m.lin(x)) * 2.0)


def test_two_instances_do_not_share_a_trace(make_config):
    a = CompiledToyModel(engine_config=make_config(mode=3))
    b = CompiledToyModel(engine_config=make_config(mode=2))
    with compilation_counter.expect(num_dynamo_traces=2, num_graphs_seen=1):
        a(torch.randn(6, 32))
        b(torch.randn(6, 32))


def test_decorator_argument_errors():
    class NoForward:
        pass

    with pytest.raises(TypeError, match="forward"):
        support_torch_compile(NoForward)

    class Untyped(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ValueError, match="dynamic_arg_dims"):
        support_torch_compile(Untyped)
    with pytest.raises(ValueError, match="'y'"):
        support_torch_compile(dynamic_arg_dims={"y": 0})(Untyped)
    assert support_torch_compile(dynamic_arg_dims={"x": 0})(Untyped) is Untyped
