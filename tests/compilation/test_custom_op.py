"""CustomOp: enable/disable selection from ``custom_ops``, counters, registries, numerics."""

from __future__ import annotations

import pytest
import torch

from forwardkit.compilation.custom_op import CustomOp
from forwardkit.config.compilation import CompilationConfig
from forwardkit.config.custom_ops import (
    CUSTOM_OP_REGISTRY,
    custom_ops_default_on,
    is_custom_op_enabled,
)
from forwardkit.config.engine import EngineConfig, set_current_engine_config
from forwardkit.layers.activation import SiluAndMul
from forwardkit.layers.layernorm import RMSNorm
from forwardkit.layers.rotary_embedding import RotaryEmbedding


def _build(custom_ops: list[str], **extra):
    config = EngineConfig(compilation_config=CompilationConfig(custom_ops=list(custom_ops), **extra))
    with set_current_engine_config(config):
        ops = RMSNorm(8), SiluAndMul(), RotaryEmbedding(8, 32)
    return config.compilation_config, ops


@pytest.mark.parametrize(
    "custom_ops, expected",
    [
        (["all"], (True, True, True)),
        (["none"], (False, False, False)),
        (["none", "+rms_norm"], (True, False, False)),
        (["all", "-rms_norm"], (False, True, True)),
        (["none", "+silu_and_mul", "+rotary_embedding"], (False, True, True)),
    ],
)
def test_selection_and_counters(cpu_platform, custom_ops, expected):
    cc, ops = _build(custom_ops)
    assert tuple(op.is_enabled for op in ops) == expected
    for op, on in zip(ops, expected):
        assert op._forward_method.__name__ == ("forward_cpu" if on else "forward_native")
        assert op.forward_form == ("cpu" if on else "native")  # the typed answer layers read
        counter = cc.enabled_custom_ops if on else cc.disabled_custom_ops
        assert counter[op.name] == 1
    assert sum(cc.enabled_custom_ops.values()) == sum(expected)
    assert sum(cc.disabled_custom_ops.values()) == 3 - sum(expected)


def test_cuda_platform_dispatches_forward_cuda(cuda_platform):
    _, (norm, act, rope) = _build(["all"])
    assert norm._forward_method.__name__ == "forward_cuda" and norm.forward_form == "cuda"
    _, (norm, _, _) = _build(["none"])
    assert norm._forward_method.__name__ == "forward_native" and norm.forward_form == "native"


def test_decision_is_made_once_at_construction(cpu_platform):
    cc, (norm, _, _) = _build(["all"])
    cc.custom_ops[:] = ["none"]
    assert norm.is_enabled


def test_enforce_enable(cpu_platform):
    config = EngineConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    with set_current_engine_config(config):
        act = SiluAndMul(enforce_enable=True)
    assert act.is_enabled and config.compilation_config.enabled_custom_ops["silu_and_mul"] == 1


@pytest.mark.parametrize(
    "mode, backend, custom_ops, on",
    [
        (3, "inductor", [], False),
        (3, "eager", [], True),
        (0, "inductor", [], True),
        (3, "inductor", ["+toy"], True),
        (3, "inductor", ["all", "-toy"], False),
        (3, "inductor", ["none", "+other"], False),
    ],
)
def test_reference_table(mode, backend, custom_ops, on):
    """vLLM 0.14.0's enabled/disabled table, including un-normalised lists."""
    assert is_custom_op_enabled(custom_ops, "toy", mode, backend) is on


def test_invalid_lists_are_clear_errors():
    with pytest.raises(ValueError, match="both enables and disables 'rms_norm'"):
        is_custom_op_enabled(["all", "+rms_norm", "-rms_norm"], "rms_norm")
    with pytest.raises(ValueError, match="one of 'none' or 'all'"):
        custom_ops_default_on(["all", "none"])


@pytest.mark.parametrize("custom_ops", [[], ["+rms_norm"], ["-silu_and_mul"], ["all"], ["none", "+rms_norm"]])
@pytest.mark.parametrize("mode, backend", [(0, "inductor"), (3, "inductor"), (3, "eager"), (2, "inductor")])
def test_one_rule_for_customop_config_and_resolution(custom_ops, mode, backend):
    """CustomOp, CompilationConfig.is_custom_op_enabled after resolution and the raw rule agree."""
    config = EngineConfig(compilation_config=CompilationConfig(custom_ops=list(custom_ops), mode=mode,
                                                               backend=backend))
    cc = config.compilation_config
    with set_current_engine_config(config):
        ops = RMSNorm(8), SiluAndMul()
    for op in ops:
        name = type(op).name
        expected = is_custom_op_enabled(custom_ops, name, mode, backend)
        assert op.is_enabled is expected
        assert cc.is_custom_op_enabled(name) is expected


def test_registry_is_shared_with_the_config_layer():
    assert CustomOp.op_registry is CUSTOM_OP_REGISTRY and CUSTOM_OP_REGISTRY["rms_norm"] is RMSNorm


def test_enabled_and_native_forms_agree(cpu_platform):
    _, on = _build(["all"])
    _, off = _build(["none"])
    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    on[0].weight.data.uniform_(0.5, 1.5, generator=gen)
    off[0].weight.data.copy_(on[0].weight.data)
    torch.testing.assert_close(on[0](x), off[0](x))
    for a, b in zip(on[0](x, r), off[0](x, r)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(on[1](x), off[1](x))
    pos = torch.tensor([0, 3, 7, 1, 30])
    q, k = torch.randn(5, 16, generator=gen), torch.randn(5, 8, generator=gen)
    for a, b in zip(on[2](pos, q, k), off[2](pos, q, k)):
        torch.testing.assert_close(a, b)


def test_enabled_op_is_opaque_in_the_traced_graph(cpu_platform):
    _, (norm_on, _, _) = _build(["all"])
    _, (norm_off, _, _) = _build(["none"])
    seen: dict[str, list[str]] = {}

    def capture(tag):
        def backend(gm, example_inputs):
            seen[tag] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return gm.forward

        return backend

    x = torch.randn(3, 8)
    torch.compile(norm_on, backend=capture("on"), fullgraph=True)(x)
    torch.compile(norm_off, backend=capture("off"), fullgraph=True)(x)
    assert any("forwardkit.rms_norm" in t for t in seen["on"])
    assert not any("forwardkit" in t for t in seen["off"])


def test_registry_duplicate_and_oot(cpu_platform):
    assert CustomOp.op_registry["rms_norm"] is RMSNorm
    with pytest.raises(AssertionError, match="Duplicate custom op name 'rms_norm'"):

        @CustomOp.register("rms_norm")
        class Other(CustomOp):
            pass

    @CustomOp.register("toy_scale")
    class ToyScale(CustomOp):
        def forward_native(self, x):
            return x * 2

    class ToyScaleOOT(ToyScale):
        def forward_native(self, x):
            return x * 3

    try:
        CustomOp.register_oot("ToyScale")(ToyScaleOOT)
        config = EngineConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
        with set_current_engine_config(config):
            op = ToyScale()
        assert type(op) is ToyScaleOOT and op(torch.ones(1)).item() == 3
        assert config.compilation_config.disabled_custom_ops["toy_scale"] == 1
    finally:
        CustomOp.op_registry_oot.pop("ToyScale", None)
        CustomOp.op_registry.pop("toy_scale", None)


def test_the_engine_configs_platform_picks_the_optimised_form(cuda_platform):
    # the process says CUDA; the config the model is built under says CPU: the config wins
    config = EngineConfig(compilation_config={"custom_ops": ["all"]}, platform="cpu")
    with set_current_engine_config(config):
        norm = RMSNorm(8)
    assert norm._forward_method.__name__ == "forward_cpu"
