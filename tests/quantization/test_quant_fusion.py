"""``fuse_norm_quant`` / ``fuse_act_quant``: a quantized projection fed by an RMSNorm or a
SiLU-and-mul takes activations rounded to int8 inside the compiled graph
(``forwardkit::quant_linear_q8``), with the products and tokens of the unfused graph."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from forwardkit.compilation.counters import compilation_counter
from forwardkit.config.builder import build_engine_config
from forwardkit.config.compilation import CompilationConfig
from forwardkit.engine import LLM, SamplingParams
from forwardkit.kernels.cpu import native_quant
from forwardkit.quantization.formats import FORMATS, _bf16_rounded, quantize, quantize_activations
from forwardkit.quantization.fusion import QuantFusionPass

needs_native = pytest.mark.skipif(not native_quant.available(),
                                  reason="no native quantized-linear build serves on this CPU")


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_bf16_rounding_in_integers_is_torch_s():
    v = torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 50
    v[:4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 0.0])  # ties, both ways
    assert torch.equal(_bf16_rounded(v), v.bfloat16().float())


@needs_native
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 33])
def test_quantized_input_gives_the_float_call_s_products_bit_for_bit(fmt, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    packed = quantize(torch.randn(40, 128, generator=gen), fmt)
    bias = torch.randn(40, generator=gen)
    x = torch.randn(rows, 128, generator=gen) * 4
    # a block whose scale is 1: x * (1 / d) lands on halves, where C roundf (away from zero)
    # and round-half-even part
    x[0, :32] = torch.arange(32) - 15.5
    x[0, 0] = 127.0
    x = x.to(dtype)
    want = torch.ops.forwardkit.quant_linear(x, packed, bias, fmt)
    got = torch.ops.forwardkit.quant_linear_q8(*quantize_activations(x), packed, bias, fmt)
    assert got.dtype == torch.float32
    assert torch.equal(got.to(dtype), want)


def _block(x, residual, norm_w, packed_qkv, packed_up, packed_down):
    h = x + residual
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)) * norm_w
    qkv = torch.ops.forwardkit.quant_linear(normed, packed_qkv, None, "q4_0")
    gate_up = torch.ops.forwardkit.quant_linear(normed, packed_up, None, "q8_0")
    act = torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:]
    down = torch.ops.forwardkit.quant_linear(act, packed_down, None, "q4_1")
    again = torch.ops.forwardkit.quant_linear(qkv, packed_down[:, :40], None, "q4_1")  # a projection's output
    return down, again


def _block_args(seed=1, rows=6):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen),
            torch.rand(64, generator=gen) + 0.5,
            quantize(torch.randn(64, 64, generator=gen), "q4_0"),
            quantize(torch.randn(128, 64, generator=gen), "q8_0"),
            quantize(torch.randn(96, 64, generator=gen), "q4_1"))


@needs_native
@pytest.mark.parametrize("norm, act", [(True, True), (True, False), (False, True), (False, False)])
def test_pass_rewrites_norm_and_act_inputs_only_and_keeps_the_products(norm, act):
    args = _block_args()
    gm = make_fx(_block, tracing_mode="fake")(*args)
    before = compilation_counter.clone()
    p = QuantFusionPass(norm, act)
    p(gm.graph)
    gm.graph.lint()
    gm.recompile()
    targets = _targets(gm)
    # the norm feeds two projections: rounded once, shared
    assert p.fired == {"norm": 2 * norm, "act": int(act)}
    assert compilation_counter.delta(before) == {
        k: v for k, v in {"num_norm_quant_fusions": 2 * norm, "num_act_quant_fusions": int(act)}.items() if v}
    assert targets.count("forwardkit.quant_linear_q8.default") == 2 * norm + act
    assert targets.count("forwardkit.quant_linear.default") == 4 - 2 * norm - act  # incl. `again`
    assert "forwardkit.quantize_activations.default" not in targets  # traced to torch ops
    fresh = _block_args(seed=2)
    for got, want in zip(gm(*fresh), _block(*fresh)):
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def compiled_tokens(llama_dir):
    """Greedy tokens of the tiny q4_0 Llama, compiled with and without the fusions and eager."""
    prompts = [{"prompt_token_ids": [1, 5, 9, 20, 33]}, {"prompt_token_ids": list(range(3, 40))}]

    def run(dtype, max_tokens=10, fuse=True, splitting_ops=None, **kwargs):
        before = compilation_counter.clone()
        if "enforce_eager" not in kwargs:
            kwargs["compilation_config"] = {"pass_config": {"fuse_norm_quant": fuse,
                                                            "fuse_act_quant": fuse},
                                            "splitting_ops": splitting_ops}
        llm = LLM(model=llama_dir, quantization="q4_0", dtype=dtype, seed=0, **kwargs)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], compilation_counter.delta(before), llm

    return run


@needs_native
def test_compiled_model_with_the_fusions_gives_the_unfused_and_eager_tokens(compiled_tokens):
    on, counts, _ = compiled_tokens("float32")
    # two layers: input and post-attention norms, one SiLU-and-mul each (every compiled range)
    assert counts.get("num_norm_quant_fusions", 0) >= 4, counts
    assert counts.get("num_act_quant_fusions", 0) >= 2, counts
    off, off_counts, _ = compiled_tokens("float32", fuse=False)
    assert "num_norm_quant_fusions" not in off_counts and "num_act_quant_fusions" not in off_counts
    eager, _, _ = compiled_tokens("float32", enforce_eager=True)
    assert on == off == eager


@needs_native
def test_bf16_fused_graph_quantizes_the_bf16_activations_eager_does(compiled_tokens):
    """In bf16 Inductor keeps a norm's or activation's intermediate in float32 inside a fused
    kernel; the fused rounding takes the activations at bf16 precision, as eager and the
    unfused graph's stored bf16 activations are, so the tokens are eager's. Checked on the
    graph split at attention (the layout with CUDA graphs): compiled as one graph (the CPU's
    default) other bf16 roundings differ from eager's (seen: the 11th token on this model),
    as the unfused graph's do in either layout."""
    on, counts, _ = compiled_tokens("bfloat16", max_tokens=16,
                                    splitting_ops=list(CompilationConfig.ATTENTION_OPS))
    assert counts.get("num_norm_quant_fusions", 0) >= 4, counts
    eager, _, _ = compiled_tokens("bfloat16", max_tokens=16, enforce_eager=True)
    assert on == eager


@pytest.mark.parametrize("kwargs, on", [
    # the level table decides, as vLLM's does: on with the rms_norm / quant_fp8 custom ops
    ({"quantization": "q4_0"}, False),
    ({"quantization": "q4_0", "compilation_config": {"custom_ops": ["+rms_norm", "+silu_and_mul"]}},
     True),
    ({"quantization": "q4_0", "compilation_config": {
        "pass_config": {"fuse_norm_quant": True, "fuse_act_quant": True}}}, True),
    ({"quantization": "q4_0", "enforce_eager": True}, False),
])
def test_the_level_table_decides_the_fusions(llama_dir, kwargs, on):
    """Measured slower than the kernels' own rounding from 16 rows (docs/design.md), so not
    turned on by default for quantized models beyond what vLLM's table does."""
    pc = build_engine_config(llama_dir, **kwargs).compilation_config.pass_config
    assert bool(pc.fuse_norm_quant) is on and bool(pc.fuse_act_quant) is on
