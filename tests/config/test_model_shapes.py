"""Named real-architecture shapes: valid configs, the published parameter counts, clear errors."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.config.model_shapes import (
    MODEL_SHAPES,
    model_shape_config,
    model_shape_names,
    weight_bytes_per_token,
)

# Parameter counts the published checkpoints have (tied embeddings counted once).
PUBLISHED_PARAMS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
}


def _meta_model(name: str) -> torch.nn.Module:
    from forwardkit.config.engine import set_current_engine_config
    from forwardkit.models import get_model_class

    cfg = build_engine_config(model_shape=name, compilation_config={"mode": 0}, platform="cpu")
    hf = cfg.model_config.hf_config
    with set_current_engine_config(cfg), torch.device("meta"):
        return get_model_class(hf["architectures"])(cfg)


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_every_shape_resolves_and_builds(name):
    cfg = build_engine_config(model_shape=name, platform="cpu")
    assert cfg.model_config.hf_config == model_shape_config(name)
    model = _meta_model(name)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_the_published_models(name):
    model = _meta_model(name)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]


def test_real_shapes_default_to_bf16_and_qwen_has_qkv_biases():
    cfg = build_engine_config(model_shape="llama-3.2-1b", platform="cpu")
    assert cfg.model_config.dtype in (torch.bfloat16, torch.float32)  # fp32 without CPU bf16
    qwen = _meta_model("qwen2.5-0.5b")
    attn = qwen.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None


def test_weight_bytes_of_a_decode_step():
    hf = model_shape_config("llama-3.2-1b")
    # every parameter but the two norms per layer and the final norm, once (tied head)
    expected = PUBLISHED_PARAMS["llama-3.2-1b"] - (2 * 16 + 1) * 2048
    assert weight_bytes_per_token(hf, 2) == 2 * expected
    moe = model_shape_config("mixtral-small")
    assert weight_bytes_per_token(moe, 2, 1) < weight_bytes_per_token(moe, 2, 16)


def test_config_copies_are_independent():
    a = model_shape_config("llama-3.2-1b")
    a["rope_scaling"]["factor"] = 1.0
    assert model_shape_config("llama-3.2-1b")["rope_scaling"]["factor"] == 32.0


def test_unknown_shape_and_conflicting_model_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model shape 'llama-9b'; accepted: \[") as err:
        model_shape_config("llama-9b")
    assert all(n in str(err.value) for n in model_shape_names())
    with pytest.raises(ValueError, match="model or model_shape, not both"):
        build_engine_config(str(tmp_path), model_shape="default")


def test_auto_bf16_runs_in_fp32_only_where_bf16_would_be_emulated(monkeypatch):
    """``dtype="auto"`` keeps a bf16 checkpoint in bf16 where its products run natively: a CPU
    with native bf16 matmuls, or AVX2 + FMA with forwardkit's AVX2 bf16 kernels (the
    ``cpu_linear`` op); elsewhere (bf16 matmuls emulated) it runs in float32."""
    import forwardkit.config.builder as builder
    from forwardkit.platforms import CpuCapabilities

    def cpu(flags: set[str]) -> None:
        monkeypatch.setattr(builder, "cpu_capabilities",
                            lambda: CpuCapabilities(frozenset(flags), "test CPU", False))

    def auto_dtype(**kw) -> torch.dtype:
        return build_engine_config(model_shape="llama-3.2-1b", platform="cpu", **kw).model_config.dtype

    monkeypatch.setattr(builder, "cpu_has_native_bf16", lambda: False)
    cpu({"avx2", "fma", "f16c"})  # an AVX2 server: the AVX2 kernels serve bf16
    assert auto_dtype() == torch.bfloat16
    # the same CPU with the native linear switched off: bf16 would be emulated
    assert auto_dtype(compilation_config={"custom_ops": ["-cpu_linear"]}) == torch.float32
    cpu({"sse4_2", "avx"})  # no AVX2: emulated
    assert auto_dtype() == torch.float32
    forced = build_engine_config(model_shape="llama-3.2-1b", dtype="bfloat16", platform="cpu")
    assert forced.model_config.dtype == torch.bfloat16  # an explicit choice is kept
    cuda = build_engine_config(model_shape="llama-3.2-1b", platform="cuda")
    assert cuda.model_config.dtype == torch.bfloat16
    monkeypatch.setattr(builder, "cpu_has_native_bf16", lambda: True)
    assert build_engine_config(model_shape="llama-3.2-1b", platform="cpu").model_config.dtype == torch.bfloat16
