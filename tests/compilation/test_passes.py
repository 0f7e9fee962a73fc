"""Post-grad passes: each fires where it must and leaves other graphs alone."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import forwardkit.layers.kernels  # noqa: F401  (registers the forwardkit:: ops)
from forwardkit.compilation.compiler import pass_context
from forwardkit.compilation.fusion import FusedAddRMSNormPass, SiluAndMulFusionPass
from forwardkit.compilation.passes import NoOpEliminationPass, PostGradPassManager
from forwardkit.config.compilation_enums import Range
from forwardkit.config.pass_config import PassConfig

aten = torch.ops.aten


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_noop_elimination_removes_identity_reshapes_and_slices():
    def f(x):
        a = x.reshape(x.shape[0], 4, 4).reshape(x.shape[0], 16)  # chain back to the same shape
        b = a[:, 0:16]  # full slice
        return b * 2

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(5, 16))
    NoOpEliminationPass()(gm.graph)
    gm.recompile()
    targets = _targets(gm)
    assert aten.slice.Tensor not in targets
    assert not any(t in NoOpEliminationPass.RESHAPES for t in targets)
    x = torch.randn(7, 16)
    torch.testing.assert_close(gm(x), f(x))


def test_noop_elimination_keeps_real_reshapes():
    def f(x):
        return x.reshape(x.shape[0], 4, 4).narrow(1, 1, 2) + 1

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(5, 16))
    before = _targets(gm)
    NoOpEliminationPass()(gm.graph)
    assert _targets(gm) == before


def _opaque_block(x, residual, w, up):
    normed, new_residual = torch.ops.forwardkit.fused_add_rms_norm(x, residual, w, 1e-6)
    h = torch.ops.forwardkit.rms_norm(normed, w, 1e-6)
    return torch.ops.forwardkit.silu_and_mul(h @ up), new_residual


def _native_block(x, residual, w, up):
    r = x + residual
    n = w * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6))
    g = n @ up
    return torch.nn.functional.silu(g[..., :16]) * g[..., 16:], r


ARGS = (torch.randn(6, 16), torch.randn(6, 16), torch.rand(16) + 0.5, torch.randn(16, 32))


def test_fusions_inline_opaque_norm_and_activation():
    gm = make_fx(_opaque_block, tracing_mode="symbolic")(*ARGS)
    norm, act = FusedAddRMSNormPass(), SiluAndMulFusionPass()
    norm(gm.graph)
    act(gm.graph)
    gm.recompile()
    assert (norm.fired, act.fired) == (2, 1)
    assert not any("forwardkit" in str(t) for t in _targets(gm))
    args = (torch.randn(9, 16), torch.randn(9, 16), ARGS[2], ARGS[3])
    torch.testing.assert_close(gm(*args), _opaque_block(*args))


def test_fusions_do_not_fire_on_native_graphs():
    gm = make_fx(_native_block, tracing_mode="symbolic")(*ARGS)
    before = _targets(gm)
    for p in (FusedAddRMSNormPass(), SiluAndMulFusionPass()):
        p(gm.graph)
        assert p.fired == 0
    assert _targets(gm) == before


def test_manager_runs_configured_passes_and_user_pass_with_range_in_uuid():
    seen = []

    def user_pass(graph):
        seen.append(len(graph.nodes))

    off = PostGradPassManager(PassConfig(eliminate_noops=False), [user_pass])
    on = PostGradPassManager(
        PassConfig(eliminate_noops=True, fuse_rms_norm=True, fuse_silu_and_mul=True), [user_pass])
    assert [type(p).__name__ for p in on.passes] == [
        "NoOpEliminationPass", "FusedAddRMSNormPass", "SiluAndMulFusionPass", "function",
    ]
    assert off.passes == [user_pass]
    gm = make_fx(_opaque_block, tracing_mode="symbolic")(*ARGS)
    with pass_context(Range(1, 8)):
        on(gm.graph)
        uuid_small = on.uuid()
    with pass_context(Range(9, 64)):
        uuid_large = on.uuid()
    assert seen and uuid_small != uuid_large and on.uuid() != off.uuid()
    assert not any("forwardkit" in str(t) for t in _targets(gm))


@pytest.mark.parametrize("flag, pass_name", [("eliminate_noops", "NoOpEliminationPass"),
                                             ("fuse_rms_norm", "FusedAddRMSNormPass"),
                                             ("fuse_silu_and_mul", "SiluAndMulFusionPass")])
def test_each_pass_has_its_own_flag(flag, pass_name):
    only = PostGradPassManager(PassConfig(**{flag: True}))
    assert [type(p).__name__ for p in only.passes] == [pass_name]
    others = {name: True for name in ("eliminate_noops", "fuse_rms_norm", "fuse_silu_and_mul")
              if name != flag}
    assert pass_name not in [type(p).__name__ for p in PostGradPassManager(PassConfig(**others)).passes]
