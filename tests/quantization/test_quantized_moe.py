"""Quantized MoE experts: a tiny Mixtral quantized on load packs every expert (gate/up and down)
in the format and generates the tokens of the same model whose expert and projection weights
hold their dequantized values (through the dequantize-then-matmul path); the native kernel
serves the experts; each layer's experts are packed as soon as its last expert tensor is
loaded; shapes that cut a block and in-place writes are refused by name."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.engine.llm import LLM
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.layers.fused_moe import FusedMoE
from forwardkit.models.loader import load_model
from forwardkit.quantization.formats import dequantize, quantize

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 120, 3]]
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# transformers holds each layer's experts stacked: gate_up [E, 2I, H], down [E, H, I]
STACKED = ("experts.gate_up_proj", "experts.down_proj")


def _mixtral(**overrides: object):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**{**TINY, **overrides}, rope_theta=10000.0,
                                     tie_word_embeddings=False, initializer_range=0.2,
                                     torch_dtype="float32")
    return transformers.MixtralForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qmixtral")
    _mixtral().save_pretrained(str(path))
    return str(path)


def _dequantized_dir(tmp_path, fmt: str) -> str:
    model = _mixtral()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                p.copy_(dequantize(quantize(p, fmt), fmt))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(dequantize(quantize(p, "q8_0"), "q8_0"))  # held in q8_0 in every format
            elif name.endswith(STACKED):
                for expert in p:  # each expert's rows, blocks along the last dim
                    expert.copy_(dequantize(quantize(expert, fmt), fmt))
        assert sum(n.endswith(STACKED) for n, _ in model.named_parameters()) == 2 * 2
    model.save_pretrained(str(tmp_path))
    return str(tmp_path)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _experts(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.runner.module.modules() if isinstance(m, FusedMoE)]


# dequantize-then-matmul (the cpu_linear op off: the native kernels' one switch): exact
PLAIN = {"compilation_config": {"custom_ops": ["-cpu_linear"]}}


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_packed_experts_give_the_dequantized_models_tokens(mixtral_dir, tmp_path, fmt):
    quant = LLM(model=mixtral_dir, quantization=fmt, enforce_eager=True, **PLAIN)
    layers = _experts(quant)
    assert len(layers) == 2
    for layer in layers:
        assert not layer.quant_kernel
        for param, (rows, k) in ((layer.w13_weight, (128, 64)), (layer.w2_weight, (64, 64))):
            assert param.dtype == torch.uint8 and param.quant_format == fmt
            assert tuple(param.shape) == (4, rows, quantize(torch.zeros(1, k), fmt).shape[1])
    reference = LLM(model=_dequantized_dir(tmp_path, fmt), enforce_eager=True, **PLAIN)
    assert _greedy(quant) == _greedy(reference)


def test_the_native_kernel_serves_the_experts_close_to_the_reference(mixtral_dir, monkeypatch):
    """With the native kernel (int8 activations) the experts' products go to it, and the
    prompt log-probabilities stay within 0.2 of the dequantize-then-matmul path's."""
    from forwardkit.kernels.cpu import native_quant

    shapes = []
    real = native_quant.quant_linear_rows

    def counting(x, packed, *args, **kwargs):
        out = real(x, packed, *args, **kwargs)
        if out is not None:
            shapes.append(tuple(packed.shape))
        return out

    def logprobs(llm: LLM) -> torch.Tensor:
        params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        out = llm.generate(prompt_token_ids=[PROMPTS[0] * 3], sampling_params=params,
                           use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for t, d in zip(PROMPTS[0] * 3, out.prompt_logprobs)
                             if d is not None])

    monkeypatch.setattr(native_quant, "quant_linear_rows", counting)
    llm = LLM(model=mixtral_dir, quantization="q8_0", enforce_eager=True)
    native = logprobs(llm)
    monkeypatch.undo()
    assert tuple(_experts(llm)[0].w13_weight.shape[1:]) in shapes  # an expert's gate/up ran natively
    exact = logprobs(LLM(model=mixtral_dir, quantization="q8_0", enforce_eager=True, **PLAIN))
    assert (native - exact).abs().max().item() < 0.2


def test_compiled_run_with_packed_experts_matches_eager(mixtral_dir):
    compiled = LLM(model=mixtral_dir, quantization="q4_0")
    eager = LLM(model=mixtral_dir, quantization="q4_0", enforce_eager=True)
    assert _greedy(compiled) == _greedy(eager)


def test_each_layers_experts_are_packed_when_its_last_tensor_arrives(mixtral_dir, watch_loading):
    """Streaming: when a tensor of layer i + 1 arrives, layer i's experts are packed already
    (never the whole model's experts at full precision)."""
    cfg = build_engine_config(mixtral_dir, quantization="q8_0", enforce_eager=True)
    checked: list[int] = []

    def check(model, name: str) -> None:
        if model is not None and name.startswith("model.layers.1."):
            layer0 = model.get_submodule("model.layers.0.block_sparse_moe.experts")
            assert layer0.w13_weight.dtype == torch.uint8
            assert layer0.w2_weight.dtype == torch.uint8
            checked.append(1)

    watch_loading(check)
    load_model(cfg)
    assert checked


def test_an_intermediate_size_that_cuts_a_block_is_named(tmp_path):
    _mixtral(intermediate_size=48).save_pretrained(str(tmp_path))
    cfg = build_engine_config(str(tmp_path), quantization="q4_0", enforce_eager=True)
    with pytest.raises(ValueError, match=r"experts of model\.layers\.0\.block_sparse_moe\.experts "
                                         r"to q4_0: their per-rank intermediate size 48"):
        load_model(cfg)


def test_packed_experts_refuse_an_in_place_write(mixtral_dir):
    from forwardkit.quantization.linear_method import QuantizedWeightReloadError

    llm = LLM(model=mixtral_dir, quantization="q8_0", enforce_eager=True)
    layer = _experts(llm)[0]
    with pytest.raises(QuantizedWeightReloadError, match=r"experts of .* are quantized"):
        layer.weight_loader(layer.w2_weight, torch.zeros(64, 64), (0, "w2"))


def test_seeded_random_experts_are_packed():
    from forwardkit.config.model_shapes import model_shape_config

    hf = {**model_shape_config("default-moe"), "intermediate_size": 352}  # 344 cuts a block
    cfg = build_engine_config(None, default_hf_config=hf, platform="cpu", quantization="q8_0",
                              enforce_eager=True)
    model = load_model(cfg)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.w13_weight.dtype == torch.uint8 for m in layers)
