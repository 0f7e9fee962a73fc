"""The inner models honour the compile contract: one fullgraph, dynamic-shape trace that
matches eager for several token counts (attention and MoE stay opaque custom ops)."""

from __future__ import annotations

import pytest
import torch

from forwardkit.forward_context import set_forward_context
from forwardkit.layers.attention import build_attention_metadata
from forwardkit.layers.kv_cache import bind_kv_cache
from forwardkit.models.loader import load_model

from .conftest import make_engine_config  # noqa: TID252


@pytest.mark.parametrize("which", ["default", "mixtral"])
@pytest.mark.parametrize("custom_ops", [["none"], ["all"]])
def test_inner_model_traces_once_and_matches_eager(which, custom_ops, request):
    from forwardkit.config.engine import EngineConfig
    from forwardkit.config.model import ModelConfig
    from forwardkit.models.default import default_hf_config

    overrides = {"compilation_config": {"mode": 0, "custom_ops": custom_ops}}  # our own compile below
    if which == "default":
        config = EngineConfig(model_config=ModelConfig(hf_config=default_hf_config()), **overrides)
    else:
        config = make_engine_config(request.getfixturevalue("mixtral_dir"), **overrides)
    model = load_model(config)
    ctx = config.compilation_config.static_forward_context
    caches = bind_kv_cache(ctx, 8, 16, torch.float32, "cpu")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model.model.forward, backend=backend, fullgraph=True, dynamic=True)
    vocab = model.config["vocab_size"]
    for n in (6, 11):  # the second size must reuse the first trace (no recompile)
        md = build_attention_metadata([n - 2, 1, 1], [n - 2, 3, 4], [[0], [1], [2]], n + 3, 16, "cpu")
        ids = torch.randint(0, vocab, (n + 3,), generator=torch.Generator().manual_seed(n))
        pos = torch.tensor([*range(n - 2), 2, 3, 0, 0, 0])
        outs = []
        for fn in (compiled, model.model):
            for cache in caches.values():
                cache.zero_()
            with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True), set_forward_context({name: md for name in ctx}, config, num_tokens=n + 3):
                outs.append(fn(ids, pos)[:n])
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
    # (Dynamo may restart one analysis internally, e.g. to specialise float scalars.)
    targets = {str(node.target) for node in graphs[-1].graph.nodes if node.op == "call_function"}
    assert any("unified_attention" in t for t in targets)
    assert any("moe_forward" in t for t in targets) == (which == "mixtral")
