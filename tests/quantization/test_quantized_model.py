"""Quantize-on-load: a quantized tiny Llama generates the tokens of the same model whose
projection weights were replaced by their dequantized values (eager and compiled), q8_0 stays
close to the unquantized model, q4_0 weights take <= 0.35x the bytes of bf16, and bad input
is refused before anything loads."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.engine.llm import LLM
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.layers.linear import Linear, LMHead, VocabEmbedding, quantized_linears
from forwardkit.models.loader import load_model

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 120, 3]]


def _greedy(llm: LLM, max_tokens: int = 12, logprobs: int | None = None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=logprobs)
    return llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture
def exact_path(request, monkeypatch):
    """``LLM`` arguments for the quantized paths whose products are dequantize-then-matmul's:
    the reference path (the ``cpu_linear`` custom op off, the native kernels' one switch) and
    the native kernel's float strategy (summed in another order)."""
    from forwardkit.kernels.cpu import native_quant

    if request.param == "reference":
        llm_args = {"compilation_config": {"custom_ops": ["-cpu_linear"]}}
    else:
        assert native_quant.available()  # the generic build runs on every CPU
        monkeypatch.setattr(native_quant, "DEFAULT_STRATEGY", "float")
        llm_args = {}
    served = []
    real = native_quant.quant_linear_rows

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(native_quant, "quant_linear_rows", counting)
    yield llm_args
    monkeypatch.undo()
    # the decode steps went to the kernel exactly when it was on
    assert any(served) == (request.param == "native-float"), served


@pytest.mark.parametrize("fmt, exact_path", [
    ("q8_0", "reference"), ("q4_0", "reference"), ("q4_1", "reference"),
    ("q8_0", "native-float"), ("q4_0", "native-float"),  # q4_1 has no native kernel
], indirect=["exact_path"])
def test_quantized_tokens_equal_dequantized_checkpoint(llama_dir, dequantized_dir, fmt, exact_path):
    quant = LLM(model=llama_dir, quantization=fmt, enforce_eager=True, **exact_path)
    module = quant.runner.module
    layers = quantized_linears(module)
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
    assert all(layer.weight.dtype == torch.uint8 for _, layer in layers)
    # the LM head and the embedding are held in q8_0 (each its own table: the model is untied)
    tables = [m for m in module.modules() if isinstance(m, (LMHead, VocabEmbedding))]
    assert len(tables) == 2
    assert all(m.weight.dtype == torch.uint8 and m.quant_method.format.name == "q8_0" for m in tables)
    assert tables[0].weight.data_ptr() != tables[1].weight.data_ptr()
    reference = LLM(model=dequantized_dir(fmt), enforce_eager=True, **exact_path)
    assert _tokens(_greedy(quant)) == _tokens(_greedy(reference))


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> list[float]:
    """Log-probability of each prompt token after the first (teacher-forced: no divergence)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    return [pos[token].logprob for token, pos in zip(prompt[1:], out.prompt_logprobs[1:])]


def test_q8_0_logprobs_close_to_unquantized(llama_dir):
    prompt = [int(t) for t in torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(1))]
    full = torch.tensor(_prompt_logprobs(LLM(model=llama_dir, enforce_eager=True), prompt))
    err = {fmt: (torch.tensor(_prompt_logprobs(LLM(model=llama_dir, quantization=fmt,
                                                   enforce_eager=True), prompt)) - full).abs().max()
           for fmt in ("q8_0", "q4_0")}
    assert err["q8_0"] < 0.15  # max over 39 positions; the logits reach ~10 (weights at std 0.2)
    assert err["q4_0"] > 10 * err["q8_0"]  # the check tells a coarser format apart


def test_a_bf16_checkpoint_quantized_in_float32_holds_the_bf16_runs_blocks(tiny_llama, tmp_path):
    """``dtype="float32"`` with quantized weights (float32 activations and KV cache, as
    llama.cpp computes) quantizes the checkpoint's very bf16 values: the same blocks, bit for
    bit, as ``dtype="bfloat16"``; only the activations differ. What the accuracy comparison
    against llama.cpp (and a user choosing precision over KV bytes) relies on."""
    tiny_llama().to(torch.bfloat16).save_pretrained(str(tmp_path))
    for fmt in ("q8_0", "q4_0"):
        runs = {dt: LLM(model=str(tmp_path), dtype=dt, quantization=fmt, enforce_eager=True)
                for dt in ("bfloat16", "float32")}
        assert runs["float32"].runner.dtype == torch.float32
        packed = {dt: {n: p for n, p in llm.runner.module.named_parameters()
                       if getattr(p, "quant_format", None) is not None} for dt, llm in runs.items()}
        assert len(packed["float32"]) == 2 * 4 + 2  # qkv, o, gate_up, down a layer; embedding, head
        for name, param in packed["float32"].items():
            assert torch.equal(param.data, packed["bfloat16"][name].data), (fmt, name)
        tokens = {dt: _tokens(_greedy(llm, max_tokens=6)) for dt, llm in runs.items()}
        assert all(len(t) == 6 for t in tokens["float32"])


def test_compiled_quantized_run_keeps_the_op_and_matches_eager(llama_dir):
    """Mode 3 (the piecewise backend) compiles the quantized model; tokens equal eager's."""
    from forwardkit.config.compilation_enums import CompilationMode

    compiled = LLM(model=llama_dir, quantization="q4_0")
    assert compiled.engine_config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    eager = LLM(model=llama_dir, quantization="q4_0", enforce_eager=True)
    assert _tokens(_greedy(compiled)) == _tokens(_greedy(eager))


def test_quant_linear_is_one_node_of_a_dynamo_graph(forwardkit_ops):
    from forwardkit.quantization.linear_method import QuantizedLinearMethod

    layer = Linear(64, 48, bias=True, quant_method=QuantizedLinearMethod("q4_0"))
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    layer.quant_method.process_weights_after_loading(layer, "w")
    x = torch.randn(3, 64)
    out, ops = forwardkit_ops(layer, x)
    torch.testing.assert_close(out, layer(x))
    assert ops == ["forwardkit.quant_linear"], ops


def test_q4_0_weight_bytes_at_most_0_35x_bf16(llama_dir):
    cfg = build_engine_config(llama_dir, dtype="bfloat16", quantization="q4_0", enforce_eager=True)
    model = load_model(cfg)
    layers = quantized_linears(model)
    packed = sum(layer.weight.numel() * layer.weight.element_size() for _, layer in layers)
    bf16 = sum(layer.input_size * layer.output_size * 2 for _, layer in layers)
    assert packed <= 0.35 * bf16
    assert packed == bf16 * 18 // 64  # 18 bytes per 32 weights


def test_each_projection_is_quantized_as_soon_as_it_is_loaded(llama_dir, watch_loading):
    """Loading streams: when a tensor is handed to the model, every projection whose tensors
    all came before is packed already (its full-precision copy is gone)."""

    cfg = build_engine_config(llama_dir, quantization="q8_0", enforce_eager=True)
    seen: list[str] = []
    checks: list[int] = []

    def check(model, name: str) -> None:
        if model is not None:
            for prefix, layer in quantized_linears(model):
                if all(p in seen for p in _hf_names(prefix)):
                    assert layer.weight.dtype == torch.uint8, prefix
                    checks.append(1)
        seen.append(name)

    watch_loading(check)
    load_model(cfg)
    assert len(checks) > 0


def _hf_names(prefix: str) -> list[str]:
    """The checkpoint tensors that make up fused projection ``prefix`` of forwardkit's model."""
    head, _, leaf = prefix.rpartition(".")
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    return [f"{head}.{p}.weight" for p in parts.get(leaf, [leaf])]


def test_unknown_format_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"quantization must be one of \['q8_0', 'q4_0', 'q4_1'\] "
                                         r"or None, got 'q5_k'"):
        build_engine_config(None, quantization="q5_k")


def test_input_dim_not_a_multiple_of_32_is_named(tmp_path, tiny_llama):
    tiny_llama(intermediate_size=80).save_pretrained(str(tmp_path))
    cfg = build_engine_config(str(tmp_path), quantization="q4_0", enforce_eager=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight to q4_0: its "
                                         r"input dim 80 .* multiple of the 32-weight block"):
        load_model(cfg)


def test_cli_generate_quantization_flag(llama_dir, capsys):
    from forwardkit.cli import main

    assert main(["generate", "--model", llama_dir, "--quantization", "q8_0", "--enforce-eager",
                 "--prompt-token-ids", "5,17,33", "--max-tokens", "4", "--output", "ids"]) == 0
    ids = capsys.readouterr().out
    want = _tokens(LLM(model=llama_dir, quantization="q8_0", enforce_eager=True).generate(
        prompt_token_ids=[[5, 17, 33]],
        sampling_params=SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False))[0]
    assert [int(t) for t in ids.replace(",", " ").split()] == want
    with pytest.raises(SystemExit) as bad:  # argparse's usage error: exit status 2
        main(["generate", "--quantization", "int3", "--prompt-token-ids", "1"])
    assert bad.value.code == 2
    assert ("argument --quantization: must be one of ['q8_0', 'q4_0', 'q4_1'], got 'int3'"
            in capsys.readouterr().err)
    # the bench refuses it before building anything (no progress line drawn first)
    with pytest.raises(SystemExit) as bad:
        main(["bench", "--generation", "--quantization", "q4_2", "--contenders", "forwardkit"])
    assert bad.value.code == 2
    err = capsys.readouterr().err
    assert "argument --quantization: must be one of ['q8_0', 'q4_0', 'q4_1'], got 'q4_2'" in err
    assert "build + first token" not in err


def test_update_weights_into_a_quantized_projection_is_refused_whole(llama_dir):
    """In-place writes into packed weights are refused before anything changes (a norm in the
    same call is not written either)."""
    from forwardkit.models.weights import WeightLoadError

    llm = LLM(model=llama_dir, quantization="q4_0", enforce_eager=True)
    module = llm.runner.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(WeightLoadError, match=r"q_proj\.weight .*quantized weights cannot be written"):
        llm.update_weights([("model.norm.weight", torch.full((64,), 3.0)),
                            ("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_tensor_parallel_shard_that_cuts_a_block_is_refused():
    """Row-parallel layers split the input dim: a rank's shard must still be whole blocks."""
    from forwardkit.config.engine import set_current_engine_config
    from forwardkit.layers.parallel import RowParallelLinear
    from forwardkit.quantization.linear_method import QuantizedLinearMethod

    cfg = build_engine_config(None, model_shape="llama-3.2-1b", quantization="q8_0", enforce_eager=True)
    with set_current_engine_config(cfg):
        whole = RowParallelLinear(128, 32, tp_rank=1, tp_size=2)  # 64 a rank: 2 blocks
        cut = RowParallelLinear(96, 32, tp_rank=1, tp_size=2)  # 48 a rank: cuts a block
    assert isinstance(whole.quant_method, QuantizedLinearMethod)
    whole.quant_method.check_shape(whole, "down_proj.weight")
    with pytest.raises(ValueError, match=r"down_proj\.weight to q8_0: its input dim 48"):
        cut.quant_method.check_shape(cut, "down_proj.weight")


def test_bench_generation_refuses_weight_borrowers_with_quantization(capsys):
    from forwardkit.cli import main

    assert main(["bench", "--generation", "--quick", "--quantization", "q8_0",
                 "--contenders", "forwardkit,transformers"]) != 0
    assert "--contenders transformers cannot run with --quantization" in capsys.readouterr().err


def test_decode_profile_names_the_quantized_projections(llama_dir):
    """``forwardkit bench --generation --profile`` on a quantized model: its projections run as
    ``forwardkit::quant_linear`` (packed weights, another width than the input), and each weight
    shape is a linear row with the input width, the LM head its own row, not folded into the
    rest of the forward."""
    from forwardkit.bench.decode_profile import profile_decode
    from forwardkit.engine.llm import LLM

    from .conftest import TINY  # noqa: TID252

    hidden, vocab, layers = TINY["hidden_size"], TINY["vocab_size"], TINY["num_hidden_layers"]
    llm = LLM(model=llama_dir, quantization="q4_0", enforce_eager=True, max_num_seqs=2)
    profile = profile_decode(llm, 1, prompt_len=5, steps=2, warmup=1)
    linear = {r.label: r for r in profile.by_kind("linear")}
    assert set(linear) == {"linear self_attn.qkv_proj", "linear self_attn.o_proj",
                           "linear mlp.gate_up_proj", "linear mlp.down_proj"}
    assert all(row.calls == layers for row in linear.values())
    assert linear["linear self_attn.o_proj"].detail == f"1x{hidden} -> {hidden}"
    (head,) = profile.by_kind("lm_head")
    assert head.detail == f"1x{hidden} -> {vocab}" and head.calls == 1
