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


def test_auto_runs_a_model_held_in_quantized_blocks_in_float32_on_a_cpu(monkeypatch):
    """``dtype="auto"`` gives a model whose weights are all in blocks (quantized on load, or a
    GGUF file of block and float32 tensors) float32 activations on a CPU, whatever the CPU:
    the products take int8 activations either way (a MoE model's experts are packed too). Not
    where 16-bit weights would double (a GGUF file with a 16-bit matrix), not on a GPU, and
    never over an explicit dtype."""
    import forwardkit.config.builder as builder

    monkeypatch.setattr(builder, "cpu_has_native_bf16", lambda: True)  # bf16 would be native

    def dtype_of(**kw) -> torch.dtype:
        kw.setdefault("platform", "cpu")
        return build_engine_config(**kw).model_config.dtype

    assert dtype_of(model_shape="llama-3.2-1b") == torch.bfloat16
    for fmt in ("q8_0", "q4_0", "q4_1"):
        assert dtype_of(model_shape="llama-3.2-1b", quantization=fmt) == torch.float32
    assert dtype_of(model_shape="llama-3.2-1b", quantization="q8_0", dtype="bfloat16") == torch.bfloat16
    assert dtype_of(model_shape="llama-3.2-1b", quantization="q8_0", platform="cuda") == torch.bfloat16
    half = {**model_shape_config("llama-3.2-1b"), "torch_dtype": "float16"}
    assert dtype_of(default_hf_config=half, quantization="q4_0") == torch.float32
    moe = {**model_shape_config("mixtral-small"), "torch_dtype": "bfloat16"}
    assert dtype_of(default_hf_config=moe) == torch.bfloat16
    assert dtype_of(default_hf_config=moe, quantization="q8_0") == torch.float32  # experts packed

    def gguf(types: dict[str, int]) -> torch.dtype:
        cfg = {**model_shape_config("llama-3.2-1b"), "gguf_tensor_types": types}
        return dtype_of(default_hf_config=cfg)

    blocks = {"token_embd.weight": 8, "blk.0.attn_q.weight": 2, "blk.0.ffn_down.weight": 12,
              "output.weight": 14, "blk.0.attn_norm.weight": 0}
    assert gguf(blocks) == torch.float32  # Q8_0 / Q4_0 / Q4_K / Q6_K and float32 norms
    assert gguf({**blocks, "token_embd.weight": 1}) == torch.bfloat16  # an F16 table stays 16-bit
    assert gguf({"blk.0.attn_q.weight": 30, "blk.0.attn_norm.weight": 0}) == torch.bfloat16  # bf16
