"""GGUF files as models: reading each tensor type (bit for bit against the ``gguf`` package, the
k-quant repacks within their stated rounding), greedy tokens of GGUF-loaded Llama / Qwen2 /
Mixtral files against transformers, Q8_0 / Q4_0 files against quantize-on-load (the same bits),
k-quant files (Q4_K, Q6_K; mixed formats in one merged projection; a packed LM head), and the
CLI with ``--tokenizer``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forwardkit.engine.llm import LLM
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.layers.linear import Linear, LMHead, quantized_linears
from forwardkit.quantization import gguf_types
from forwardkit.quantization.formats import dequantize, quantize
from forwardkit.quantization.linear_method import SplitQuantizedLinearMethod

from .gguf_files import (  # noqa: TID252
    bpe_vocabulary,
    gguf_tensors,
    random_k_blocks,
    write_gguf,
)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
T = gguf.GGMLQuantizationType

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 120, 3]]
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def _greedy(llm: LLM, max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_greedy(model, max_tokens: int = 10) -> list[list[int]]:
    model.generation_config.eos_token_id = None  # like ignore_eos
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                for p in PROMPTS]


def _hf_model(kind: str, **overrides):
    torch.manual_seed(0)
    cfg_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[kind]
    cfg = cfg_cls(**{**TINY, **overrides}, initializer_range=0.2, torch_dtype="float32")
    return model_cls(cfg).eval()


@pytest.fixture
def reference_path():
    """``LLM`` arguments for quantized projections by dequantize-then-matmul (the native
    kernels' one switch, the ``cpu_linear`` custom op, off): a packed model then computes what a
    dense model holding the dequantized values computes."""
    return {"compilation_config": {"custom_ops": ["-cpu_linear"]}}


# ---------------------------------------------------------------- tensor types


def _random_k(kind, rows=8, k=512, seed=0) -> torch.Tensor:
    return torch.from_numpy(random_k_blocks(kind, rows, k, seed))


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K])
def test_k_quant_dequantize_is_gguf_bit_for_bit(kind):
    raw = _random_k(kind)
    ref = gguf.quants.dequantize(raw.numpy(), kind)
    size = 144 if kind == T.Q4_K else 210
    mine = (gguf_types.dequantize_q4_k if kind == T.Q4_K else gguf_types.dequantize_q6_k)(
        raw.reshape(-1, size)).reshape(ref.shape)
    assert np.array_equal(mine.numpy().view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("kind, fmt", [(T.Q8_0, "q8_0"), (T.Q4_0, "q4_0"), (T.Q4_1, "q4_1")])
def test_block_types_are_forwardkit_formats_bit_for_bit(kind, fmt):
    """The same bytes: gguf's quantization equals ours, and our dequantization equals gguf's."""
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    raw = gguf.quants.quantize(w.numpy(), kind)
    assert np.array_equal(quantize(w, fmt).numpy(), raw)
    kept = gguf_types.packed_values(torch.from_numpy(raw), kind.name, 6)
    assert torch.equal(kept, torch.from_numpy(raw))
    assert np.array_equal(dequantize(kept, fmt).numpy().view(np.uint32),
                          gguf.quants.dequantize(raw, kind).view(np.uint32))


def test_q4_k_repacks_into_q4_1_within_fp16_rounding():
    raw = _random_k(T.Q4_K, rows=16, k=1024, seed=5)
    exact = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), T.Q4_K))
    repacked = dequantize(gguf_types.repack_q4_k(raw, 16), "q4_1")
    scale, offset, _ = gguf_types._q4_k_parts(raw.reshape(-1, 144))
    # per sub-block: 15 steps of the rounded scale, plus the rounded minimum (2^-11 relative each)
    bound = (2.0 ** -11 * (15 * scale.abs() + offset.abs())).reshape(16, -1, 1).expand(16, 32, 32)
    err = (repacked - exact).abs().reshape(16, -1, 32)
    assert (err <= bound * 1.0001).all()
    assert err.max() > 0  # the fp16 roundings do show (the bound is not vacuous)


def test_q6_k_requantizes_into_q8_0_within_half_a_step():
    raw = _random_k(T.Q6_K, rows=16, k=1024, seed=6)
    exact = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), T.Q6_K)).reshape(-1, 32)
    repacked = dequantize(gguf_types.repack_q6_k(raw, 16), "q8_0").reshape(-1, 32)
    amax = exact.abs().amax(dim=1, keepdim=True)
    # half a q8_0 step (amax / 127 / 2) plus the fp16 rounding of the scale over 127 steps
    assert ((repacked - exact).abs() <= amax * (1 / 254 + 2.0 ** -11) * 1.0001).all()
    # and it is the q8_0 reference quantization of ggml's values
    assert torch.equal(gguf_types.repack_q6_k(raw, 16).reshape(-1, 34),
                       quantize(exact.reshape(16, -1), "q8_0").reshape(-1, 34))


# ---------------------------------------------------------------- float files vs transformers


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_f32_file_generates_the_transformers_tokens(tmp_path, kind):
    overrides = {"num_local_experts": 4, "num_experts_per_tok": 2} if kind == "mixtral" else {}
    model = _hf_model(kind, **overrides)
    cfg = {**TINY, **overrides}
    arch = "qwen2" if kind == "qwen2" else "llama"
    path = write_gguf(str(tmp_path / f"{kind}.gguf"), arch, cfg,
                      gguf_tensors(model.state_dict(), cfg, arch))
    llm = LLM(model=path, enforce_eager=True)
    assert llm.model_config.dtype == torch.float32  # an F32 file runs in float32
    assert llm.model_config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                             "mixtral": "MixtralForCausalLM"}[kind]
    assert _greedy(llm) == _hf_greedy(model)


def test_f16_file_with_tied_embedding_generates_the_rounded_models_tokens(tmp_path):
    """F16 matrices load as dense weights in the model dtype; no ``output.weight``: tied."""
    model = _hf_model("llama", tie_word_embeddings=True)
    cfg = {**TINY, "tie_word_embeddings": True}
    tensors = gguf_tensors(model.state_dict(), cfg, "llama")
    assert "output.weight" not in tensors
    path = write_gguf(str(tmp_path / "f16.gguf"), "llama", cfg, tensors,
                      type_of=lambda name, a: T.F16)
    with torch.no_grad():  # the reference holds the fp16-rounded matrices (norms stay float32)
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    llm = LLM(model=path, dtype="float32", enforce_eager=True)
    assert llm.model_config.hf_config["tie_word_embeddings"] is True
    head = next(m for m in llm.runner.module.modules() if isinstance(m, LMHead))
    assert head.tied
    assert _greedy(llm) == _hf_greedy(model)


# ---------------------------------------------------------------- quantized files


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_q8_0_q4_0_file_has_the_bits_and_tokens_of_quantize_on_load(tmp_path, fmt):
    model = _hf_model("llama")
    hf_dir = tmp_path / "hf"
    model.save_pretrained(str(hf_dir))
    kind = T[fmt.upper()]
    projections = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    tables = ("token_embd.weight", "output.weight")  # q8_0 on load, whatever the projections'

    def type_of(name: str, a: np.ndarray) -> T:
        if name.split(".")[-2] in projections:
            return kind
        return T.Q8_0 if name in tables else T.F32

    path = write_gguf(str(tmp_path / f"{fmt}.gguf"), "llama", TINY,
                      gguf_tensors(model.state_dict(), TINY, "llama"), type_of=type_of)
    from_file = LLM(model=path, dtype="float32", enforce_eager=True)
    on_load = LLM(model=str(hf_dir), quantization=fmt, enforce_eager=True)
    file_layers = dict(quantized_linears(from_file.runner.module))
    load_layers = dict(quantized_linears(on_load.runner.module))
    assert sorted(file_layers) == sorted(load_layers) and len(file_layers) == 8
    for name, layer in load_layers.items():
        assert file_layers[name].quant_method.format.name == fmt
        assert torch.equal(file_layers[name].weight, layer.weight), name  # the same bytes
    file_head, load_head = from_file.runner.module.lm_head, on_load.runner.module.lm_head
    assert load_head.quant_method.format.name == file_head.quant_method.format.name == "q8_0"
    assert torch.equal(file_head.weight, load_head.weight)
    # the token embedding stays packed too: the file's bytes, looked up row by row
    file_table = from_file.runner.module.model.embed_tokens
    load_table = on_load.runner.module.model.embed_tokens
    assert file_table.quant_method.format.name == load_table.quant_method.format.name == "q8_0"
    assert torch.equal(file_table.weight, load_table.weight)
    assert _greedy(from_file) == _greedy(on_load)


K_CFG = dict(TINY, hidden_size=256, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2)


def _k_quant_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A Q4_K_M-like mix: projections Q4_K, ``attn_v`` / ``ffn_down`` and the head Q6_K
    (random valid blocks); the embedding Q4_K; norms F32."""
    model = _hf_model("llama", **{k: K_CFG[k] for k in ("hidden_size", "intermediate_size")})
    tensors = gguf_tensors(model.state_dict(), K_CFG, "llama")
    for i, (name, a) in enumerate(sorted(tensors.items())):
        if a.ndim == 2:
            six = name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight"))
            tensors[name] = random_k_blocks(T.Q6_K if six else T.Q4_K, a.shape[0], a.shape[1],
                                            seed + i)
    return tensors


def _k_type(name: str, a: np.ndarray):
    return T.Q6_K if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")) else T.Q4_K


def _dense_twin(tensors: dict[str, np.ndarray], path) -> str:
    """A float32 HF checkpoint holding what forwardkit holds after the repack: Q4_K as its q4_1
    values, Q6_K as its q8_0 values, Q/K rows back in Hugging Face order."""
    from safetensors.torch import save_file

    heads, kv = K_CFG["num_attention_heads"], K_CFG["num_key_value_heads"]
    state = {}
    names = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight"}
    for name, a in tensors.items():
        if a.dtype == np.uint8:
            kind = _k_type(name, a)
            raw = torch.from_numpy(a)
            if kind == T.Q4_K:  # the embedding too: it stays packed, repacked like a projection
                values = dequantize(gguf_types.repack_q4_k(raw, a.shape[0]), "q4_1")
            else:
                values = dequantize(gguf_types.repack_q6_k(raw, a.shape[0]), "q8_0")
        else:
            values = torch.from_numpy(a)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            h = heads if "attn_q" in name else kv
            values = values.reshape(h, -1, 2, values.shape[1]).transpose(1, 2).reshape(values.shape)
        if name == "token_embd.weight":
            state["model.embed_tokens.weight"] = values
        elif name == "output.weight":
            state["lm_head.weight"] = values
        elif name == "output_norm.weight":
            state["model.norm.weight"] = values
        else:
            _, layer, rest = name.split(".", 2)
            state[f"model.layers.{layer}.{names[rest]}"] = values
    path.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    cfg = {**K_CFG, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "torch_dtype": "float32", "head_dim": 64}
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_k_quant_file_repacks_and_generates_its_values_tokens(tmp_path, reference_path, monkeypatch):
    """Q4_K -> q4_1, Q6_K -> q8_0 (``attn_v`` in another format than q/k: a split projection;
    the head packed; the Q4_K embedding dequantized a few rows at a time); tokens equal those of
    a dense model holding the repacked values."""
    from forwardkit.models import gguf_loader

    monkeypatch.setattr(gguf_loader, "_CHUNK_WEIGHTS", 1000)  # 3 embedding rows per chunk
    tensors = _k_quant_tensors()
    path = write_gguf(str(tmp_path / "k.gguf"), "llama", K_CFG, tensors, type_of=_k_type)
    llm = LLM(model=path, dtype="float32", enforce_eager=True, **reference_path)
    module = llm.runner.module
    formats = {name: m.quant_method.format.name for name, m in module.named_modules()
               if isinstance(m, (Linear, LMHead)) and m.quant_method is not None}
    assert formats["model.layers.0.mlp.down_proj"] == "q8_0"
    assert formats["model.layers.0.mlp.gate_up_proj"] == "q4_1"
    assert formats["lm_head"] == "q8_0"
    qkv = module.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv.quant_method, SplitQuantizedLinearMethod)
    assert [(rows, f.name) for rows, f in qkv.quant_method.parts] == [(256, "q4_1"), (128, "q4_1"),
                                                                      (128, "q8_0")]
    reference = LLM(model=_dense_twin(tensors, tmp_path / "twin"), enforce_eager=True,
                    **reference_path)
    assert _greedy(llm) == _greedy(reference)


@pytest.mark.parametrize("up_type", ["Q8_0", "Q4_0"])
def test_mixtral_file_keeps_its_quantized_experts_packed(tmp_path, reference_path, up_type):
    """Stacked expert tensors in a native type stay packed (each layer's ``w13`` when gate and
    up share a format, else dequantized exactly; ``w2`` on its own), the projections too, and
    the model generates the tokens of the same model holding the dequantized values."""
    from forwardkit.layers.fused_moe import FusedMoE

    overrides = {"num_local_experts": 4, "num_experts_per_tok": 2}
    model = _hf_model("mixtral", **overrides)
    cfg = {**TINY, **overrides}

    def type_of(name, a):
        if a.ndim < 2 or "token_embd" in name or name == "output.weight" or "gate_inp" in name:
            return T.F32
        return T[up_type] if "ffn_up_exps" in name else T.Q8_0

    path = write_gguf(str(tmp_path / "moe.gguf"), "llama", cfg,
                      gguf_tensors(model.state_dict(), cfg, "llama"), type_of=type_of)
    llm = LLM(model=path, dtype="float32", enforce_eager=True, **reference_path)
    assert len(quantized_linears(llm.runner.module)) == 2 * 2  # qkv and o per layer
    layers = [m for m in llm.runner.module.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2
    for layer in layers:
        assert layer.w2_weight.dtype == torch.uint8 and layer.w2_weight.quant_format == "q8_0"
        packed_w13 = up_type == "Q8_0"  # gate Q8_0 and up Q4_0 cannot share one packed w13
        assert (layer.w13_weight.dtype == torch.uint8) == packed_w13
    # the reference: every quantized tensor replaced by its dequantized values
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                for expert in p:  # gate_up [E, 2I, H]: gate rows, then up rows
                    if "gate_up" in name:
                        inter = expert.shape[0] // 2
                        for part, fmt in ((expert[:inter], "q8_0"), (expert[inter:], up_type.lower())):
                            part.copy_(dequantize(quantize(part, fmt), fmt))
                    else:
                        expert.copy_(dequantize(quantize(expert, "q8_0"), "q8_0"))
            elif p.dim() == 2 and "self_attn" in name:
                p.copy_(dequantize(quantize(p, "q8_0"), "q8_0"))
    assert _greedy(llm) == _hf_greedy(model)


def test_packed_experts_over_two_tp_ranks_give_the_one_rank_tokens(tmp_path):
    """Under TP each rank keeps its gate/up rows and its whole blocks of the down columns."""
    overrides = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128}
    model = _hf_model("mixtral", **overrides)
    cfg = {**TINY, **overrides}
    path = write_gguf(str(tmp_path / "moe.gguf"), "llama", cfg,
                      gguf_tensors(model.state_dict(), cfg, "llama"),
                      type_of=lambda name, a: T.Q8_0 if "_exps" in name else T.F32)
    one = LLM(model=path, dtype="float32", enforce_eager=True)
    want = _greedy(one)
    two = LLM(model=path, dtype="float32", enforce_eager=True, tensor_parallel_size=2)
    try:
        assert _greedy(two) == want
    finally:
        two.shutdown()


def test_a_tp_split_of_packed_experts_that_cuts_a_block_is_named():
    from forwardkit.config.builder import build_engine_config
    from forwardkit.config.engine import set_current_engine_config
    from forwardkit.layers.fused_moe import FusedMoE

    cfg = build_engine_config(None, model_shape="default-moe", enforce_eager=True)
    with set_current_engine_config(cfg):
        layer = FusedMoE(4, 2, 64, 96, prefix="cut.experts")
    layer.inter_tp, layer.inter_start, layer.local_intermediate = 2, 48, 48  # rank 1 of 2
    packed = quantize(torch.randn(4 * 64, 96), "q8_0").reshape(4, 64, -1)
    with pytest.raises(ValueError, match=r"intermediate columns \[48, 96\) cut a 32-weight block"):
        layer.local_packed(packed, "w2", "q8_0")
    gate = quantize(torch.randn(4 * 96, 64), "q8_0").reshape(4, 96, -1)
    assert torch.equal(layer.local_packed(gate, "w1", "q8_0"), gate[:, 48:])  # rows: any split


# ---------------------------------------------------------------- the CLI


def test_cli_generate_runs_a_gguf_with_a_tokenizer_dir(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from forwardkit import cli

    words = ["hello", "world", "the", "cat", "sat"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(str(tmp_path / "tok"))
    model = _hf_model("llama")
    path = write_gguf(str(tmp_path / "m.gguf"), "llama", TINY,
                      gguf_tensors(model.state_dict(), TINY, "llama"))
    argv = ["generate", "--model", path, "--prompt", "the cat sat", "--max-tokens", "4",
            "--ignore-eos", "--output", "json", "--enforce-eager"]
    assert cli.main([*argv, "--tokenizer", str(tmp_path / "tok")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_token_ids"] == [5, 6, 7]
    expected = _hf_greedy_one(model, [5, 6, 7], 4)
    assert record["token_ids"] == expected
    # without a tokenizer (the file has no vocabulary) a text prompt is refused by name
    assert cli.main(argv) != 0
    err = capsys.readouterr().err
    assert "--prompt needs a tokenizer" in err and "--tokenizer DIR" in err


def _hf_greedy_one(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None  # like --ignore-eos
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_gguf_vocabulary_gives_the_tokenizer(tmp_path):
    """A file with a vocabulary (``gpt2`` BPE) needs no tokenizer directory: text prompts are
    encoded by the tokenizer transformers builds from it, ids as the original tokenizer's."""
    tok, vocabulary = bpe_vocabulary(["the cat sat on the mat", "hello world"] * 20)
    vocab = tok.get_vocab_size()
    model = _hf_model("llama", vocab_size=vocab)
    cfg = {**TINY, "vocab_size": vocab}
    path = write_gguf(str(tmp_path / "v.gguf"), "llama", cfg,
                      gguf_tensors(model.state_dict(), cfg, "llama"), metadata=vocabulary)
    llm = LLM(model=path, enforce_eager=True)
    assert llm.tokenizer is not None and llm.eos_token_id == 1
    ids = tok.encode("the cat sat").ids
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = llm.generate(["the cat sat"], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == _hf_greedy_one(model, ids, 5)
    assert out.outputs[0].text == tok.decode(list(out.outputs[0].token_ids))


def test_large_load_logs_progress(tmp_path, monkeypatch, fk_log_records):
    """Loads of more than PROGRESS_MIN_BYTES log every 10 % (here the threshold is lowered)."""
    from forwardkit.models import gguf_loader

    model = _hf_model("llama")
    path = write_gguf(str(tmp_path / "p.gguf"), "llama", TINY,
                      gguf_tensors(model.state_dict(), TINY, "llama"))
    monkeypatch.setattr(gguf_loader, "PROGRESS_MIN_BYTES", 1)
    LLM(model=path, enforce_eager=True)
    lines = [r.getMessage() for r in fk_log_records if r.getMessage().startswith("Loading ")]
    percents = [int(line.split(": ")[1].split("%")[0]) for line in lines]
    assert percents == sorted(percents) and percents[-1] == 100 and len(percents) >= 5, lines
    assert all(path in line for line in lines)


def test_compiled_k_quant_file_matches_eager(tmp_path):
    """Mode 3 compiles the packed model (split projections, packed head) with the op calls as
    graph nodes; its tokens equal the eager run's."""
    from forwardkit.config.compilation_enums import CompilationMode

    path = write_gguf(str(tmp_path / "k.gguf"), "llama", K_CFG, _k_quant_tensors(1), type_of=_k_type)
    compiled = LLM(model=path, dtype="float32")
    assert compiled.engine_config.compilation_config.mode == CompilationMode.VLLM_COMPILE
    eager = LLM(model=path, dtype="float32", enforce_eager=True)
    assert _greedy(compiled) == _greedy(eager)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 2.0},
], ids=["llama3", "linear"])
def test_rope_freqs_tensor_becomes_the_rotary_scaling(tmp_path, scaling):
    """A ``rope_freqs`` tensor (as forwardkit's exporter and llama.cpp's converter write it)
    gives back the scaling it was made from; tokens equal transformers' scaled model."""
    from forwardkit.bench.gguf_export import write_llama_gguf

    model = _hf_model("llama", rope_scaling=dict(scaling), rope_theta=500000.0)
    path = write_llama_gguf(tmp_path / "rope.gguf", model.config.to_dict(), model.state_dict())
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True)
    got = llm.model_config.hf_config["rope_scaling"]
    assert got["rope_type"] == scaling["rope_type"]
    assert got["factor"] == pytest.approx(scaling["factor"], rel=1e-5)
    assert got == pytest.approx(scaling, rel=1e-5)
    assert _greedy(llm) == _hf_greedy(model)


def test_tied_quantized_embedding_is_one_packed_table(tmp_path, reference_path):
    """No ``output.weight`` and a Q8_0 ``token_embd``: the embedding holds the file's bytes
    (each lookup dequantizes its rows) and the head shares that one table; tokens equal
    transformers' model holding the dequantized table."""
    model = _hf_model("llama", tie_word_embeddings=True)
    cfg = {**TINY, "tie_word_embeddings": True}
    tensors = gguf_tensors(model.state_dict(), cfg, "llama")
    path = write_gguf(str(tmp_path / "tied.gguf"), "llama", cfg, tensors,
                      type_of=lambda name, a: T.Q8_0 if name == "token_embd.weight" else T.F32)
    llm = LLM(model=path, dtype="float32", enforce_eager=True, **reference_path)
    module = llm.runner.module
    head = module.lm_head
    assert head.quant_method is not None and head.quant_method.format.name == "q8_0"
    raw = torch.from_numpy(gguf.quants.quantize(tensors["token_embd.weight"], T.Q8_0))
    embedding = module.model.embed_tokens
    assert embedding.quant_method is not None and embedding.quant_method.format.name == "q8_0"
    assert torch.equal(embedding.weight, raw)  # the file's bytes
    assert head.weight is embedding.weight  # one table
    table = dequantize(raw, "q8_0")
    ids = torch.tensor([0, 5, 17, 3])
    assert torch.equal(embedding(ids), table[ids])  # the rows of the dequantized table
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(table)  # tied: the HF head uses it too
    assert _greedy(llm) == _hf_greedy(model)
