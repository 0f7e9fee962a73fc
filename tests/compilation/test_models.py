"""Modes 0-3 on tiny Llama and Mixtral: outputs match eager, and modes 2/3 trace exactly once
for steps of 1, 3, 17 and 64 tokens (attention metadata built the way the runner does)."""

from __future__ import annotations

import pytest
import torch

from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.compilation import CompilationConfig
from forwardkit.config.engine import EngineConfig, set_current_engine_config
from forwardkit.config.model import ModelConfig
from forwardkit.forward_context import set_forward_context
from forwardkit.layers.attention import build_attention_metadata
from forwardkit.layers.kv_cache import bind_kv_cache
from forwardkit.models.default import init_random_weights
from forwardkit.models.llama import LlamaForCausalLM
from forwardkit.models.mixtral import MixtralForCausalLM

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2)
ARCH = {"llama": LlamaForCausalLM, "mixtral": MixtralForCausalLM}
STEPS = [64, 17, 3, 1]
ATTENTION_OPS = CompilationConfig.ATTENTION_OPS


def _build(arch: str, mode: int, backend: str = "eager", **cc):
    hf = dict(TINY, architectures=[ARCH[arch].__name__])
    cfg = EngineConfig(model_config=ModelConfig(hf_config=hf, dtype=torch.float32),
                       compilation_config=dict(mode=mode, backend=backend, **cc))
    with set_current_engine_config(cfg):
        model = ARCH[arch](cfg)
    init_random_weights(model)
    ctx = cfg.compilation_config.static_forward_context
    return cfg, model, ctx, bind_kv_cache(ctx, 8, 16, torch.float32, "cpu")


def _step(built, n: int) -> torch.Tensor:
    cfg, model, ctx, caches = built
    for c in caches.values():
        c.zero_()
    # one prefill of n tokens in blocks 0..3
    md = build_attention_metadata([n], [n], [[0, 1, 2, 3]], n, 16, "cpu")
    ids = torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
    with torch.no_grad(), set_forward_context({k: md for k in ctx}, cfg, num_tokens=n):
        return model(ids, torch.arange(n))


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("mode", [0, 1, 2, 3, "3-split"])
def test_modes_match_eager_and_trace_once(arch, mode):
    ref = _build(arch, 0)
    split = mode == "3-split"  # on the CPU mode 3 compiles one graph unless splitting ops are listed
    if split:
        mode = 3
    built = _build(arch, mode, **({"splitting_ops": list(ATTENTION_OPS)} if split else {}))
    before = compilation_counter.clone()
    for n in STEPS:
        torch.testing.assert_close(_step(built, n), _step(ref, n), rtol=1e-5, atol=1e-5)
    traces = compilation_counter.num_dynamo_traces - before.num_dynamo_traces
    if mode in (2, 3):
        assert traces == 1 and compilation_counter.num_recompiles == before.num_recompiles
    if mode == 3:
        backend = built[1].model._fk_backend
        if split:  # 2 attention layers -> 5 pieces, attention kept eager
            assert len(backend.pieces) == 5
            assert [p.is_splitting_graph for p in backend.pieces] == [False, True, False, True, False]
        else:  # one piece; attention is an opaque op inside it
            assert len(backend.pieces) == 1 and not backend.pieces[0].is_splitting_graph
    if mode == 0:
        assert traces == 0


@pytest.mark.slow
def test_llama_mode3_inductor_matches_eager():
    ref, built = _build("llama", 0), _build("llama", 3, "inductor")
    with compilation_counter.expect(num_dynamo_traces=1, num_recompiles=0):
        for n in STEPS:
            torch.testing.assert_close(_step(built, n), _step(ref, n), rtol=1e-4, atol=1e-4)
