"""The llama.cpp contender: the GGUF written from forwardkit's weights holds the same tensors
under llama.cpp's names (Q/K rows in its rotary order); with llama.cpp installed it generates
forwardkit's greedy tokens, without it the benchmark leaves it out with a note. The Q/K layout
is checked without the binding: against llama.cpp's published row permutation written out here
and by attention scores under each engine's rotary convention."""

from __future__ import annotations

import gguf  # a dev dependency (the GGUF writer); llama.cpp itself is optional
import pytest
import torch

from forwardkit.bench.generation import hf_state_dict
from forwardkit.bench.gguf_export import _rotary_interleaved, write_llama_gguf
from forwardkit.bench.llamacpp import llamacpp_available, llamacpp_missing_note
from forwardkit.engine import LLM, SamplingParams

ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=128)
# llama3 rotary scaling with a short original context, so the per-frequency divisors vary
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def llm():
    return LLM(seed=3, **ENGINE)


@pytest.fixture(scope="module")
def scaled_llm():
    from forwardkit.config import build_engine_config
    from forwardkit.config.model_shapes import BUILTIN_MODEL_SHAPE, model_shape_config

    hf = {**model_shape_config(BUILTIN_MODEL_SHAPE), "rope_scaling": LLAMA3}
    return LLM(engine_config=build_engine_config(default_hf_config=hf, platform="cpu", **ENGINE),
               seed=4)


@pytest.fixture(scope="module")
def biased_llm():
    """The built-in shape as Qwen2 (biases on q/k/v), biases drawn large enough to matter."""
    from forwardkit.config import build_engine_config
    from forwardkit.config.model_shapes import BUILTIN_MODEL_SHAPE, model_shape_config

    hf = {**model_shape_config(BUILTIN_MODEL_SHAPE), "architectures": ["Qwen2ForCausalLM"],
          "model_type": "qwen2"}
    llm = LLM(engine_config=build_engine_config(default_hf_config=hf, platform="cpu", **ENGINE),
              seed=5)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in llm.runner.module.named_parameters():
            if name.endswith("_proj.bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return llm


def test_attention_biases_follow_their_rows(biased_llm, tmp_path):
    hf = biased_llm.runner.model_config.hf_config
    state = hf_state_dict(biased_llm.runner.model)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    path = write_llama_gguf(tmp_path / "m.gguf", hf, state)
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(path).tensors}
    for ours, theirs, heads in (("q", "q", hf["num_attention_heads"]),
                                ("k", "k", hf["num_key_value_heads"]), ("v", "v", None)):
        bias = state[f"model.layers.1.self_attn.{ours}_proj.bias"]
        want = bias if heads is None else _rotary_interleaved(bias[:, None], heads)[:, 0]
        torch.testing.assert_close(tensors[f"blk.1.attn_{theirs}.bias"], want.float())
    assert not torch.equal(tensors["blk.1.attn_q.bias"], state["model.layers.1.self_attn.q_proj.bias"])


def test_a_scaled_rotary_goes_as_rope_freqs(scaled_llm, tmp_path):
    from forwardkit.layers.rotary_embedding import _default_inv_freq

    hf = scaled_llm.runner.model_config.hf_config
    path = write_llama_gguf(tmp_path / "m.gguf", hf, hf_state_dict(scaled_llm.runner.model))
    (freqs,) = [t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
    factors = torch.from_numpy(freqs.data.copy())
    head_dim = hf["head_dim"]
    assert factors.shape == (head_dim // 2,)
    assert factors[0] == 1.0 and factors[-1] == pytest.approx(8.0)  # fast dims kept, slow / 8
    rotary = scaled_llm.runner.model.model.layers[0].self_attn.rotary_emb
    row = rotary.cos_sin_cache[1].double()  # cos, then sin, of position 1 x each frequency
    scaled = torch.atan2(row[head_dim // 2:], row[: head_dim // 2])
    torch.testing.assert_close(scaled, (_default_inv_freq(10000.0, head_dim) / factors).double(),
                               rtol=1e-4, atol=1e-6)


def test_rotary_reorder_interleaves_each_heads_halves():
    w = torch.arange(2 * 8, dtype=torch.float32).repeat_interleave(3).view(16, 3)  # 2 heads x 8
    out = _rotary_interleaved(w, heads=2)
    # per head: rows (0, 4, 1, 5, 2, 6, 3, 7): the pairs rotated together sit side by side
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    assert out[:, 0].tolist() == [float(r) for r in order + [8 + r for r in order]]


def test_gguf_holds_the_same_tensors(llm, tmp_path):
    hf = llm.runner.model_config.hf_config
    state = hf_state_dict(llm.runner.model)
    path = write_llama_gguf(tmp_path / "m.gguf", hf, state)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layers = hf["num_hidden_layers"]
    assert len(tensors) == 3 + 9 * layers  # embedding, final norm, LM head (untied) + per layer
    fields = {f.name: f for f in reader.fields.values()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert int(fields["llama.block_count"].parts[-1][0]) == layers
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == hf["num_key_value_heads"]

    def back(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(t.data.copy()).view(*reversed([int(d) for d in t.shape]))

    torch.testing.assert_close(back("token_embd.weight"), state["model.embed_tokens.weight"])
    torch.testing.assert_close(back("blk.1.ffn_down.weight"), state["model.layers.1.mlp.down_proj.weight"])
    torch.testing.assert_close(back("blk.0.attn_k.weight"), _rotary_interleaved(
        state["model.layers.0.self_attn.k_proj.weight"], hf["num_key_value_heads"]))
    assert not torch.equal(back("blk.0.attn_q.weight"), state["model.layers.0.self_attn.q_proj.weight"])


def _llamacpp_row_order(rows: int, heads: int) -> list[int]:
    """llama.cpp's published Q/K permutation (its HF converter's ``permute``), written out row
    by row: in each head, output rows 2i and 2i+1 are the input rows i and i + half."""
    per_head = rows // heads
    half = per_head // 2
    order = []
    for h in range(heads):
        for i in range(half):
            order += [h * per_head + i, h * per_head + half + i]
    return order


def _rope_half_split(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """Hugging Face Llama's rotary ([heads, d]): dimension i pairs with i + d/2."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _rope_adjacent_pairs(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """llama.cpp's rotary for the llama architecture ([heads, d]): dimension 2i pairs with 2i+1."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def test_gguf_q_k_rows_follow_llamacpps_rotary_layout(llm, tmp_path):
    """Read back with ``gguf``'s reader (no llama.cpp binding needed), the exported Q and K rows
    are the HF rows in llama.cpp's published order, and attention scores computed the llama.cpp
    way (adjacent-pair rotary on the exported rows) equal Hugging Face's (half-split rotary on
    the original rows) for every query head and the KV head it reads."""
    hf = llm.runner.model_config.hf_config
    state = hf_state_dict(llm.runner.model)
    reader = gguf.GGUFReader(write_llama_gguf(tmp_path / "m.gguf", hf, state))
    tensors = {t.name: t for t in reader.tensors}

    def back(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(t.data.copy()).view(*reversed([int(d) for d in t.shape])).double()

    heads, kv_heads, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    base = float(hf.get("rope_theta", 10000.0))
    gen = torch.Generator().manual_seed(0)
    x_q, x_k = (torch.randn(hf["hidden_size"], generator=gen, dtype=torch.float64) for _ in "qk")
    for layer in range(hf["num_hidden_layers"]):
        wq = state[f"model.layers.{layer}.self_attn.q_proj.weight"].double()
        wk = state[f"model.layers.{layer}.self_attn.k_proj.weight"].double()
        gq, gk = back(f"blk.{layer}.attn_q.weight"), back(f"blk.{layer}.attn_k.weight")
        assert torch.equal(gq, wq[_llamacpp_row_order(wq.shape[0], heads)])
        assert torch.equal(gk, wk[_llamacpp_row_order(wk.shape[0], kv_heads)])
        for pos_q, pos_k in ((5, 2), (37, 0)):
            hf_q = _rope_half_split((wq @ x_q).view(heads, d), pos_q, base)
            hf_k = _rope_half_split((wk @ x_k).view(kv_heads, d), pos_k, base)
            cpp_q = _rope_adjacent_pairs((gq @ x_q).view(heads, d), pos_q, base)
            cpp_k = _rope_adjacent_pairs((gk @ x_k).view(kv_heads, d), pos_k, base)
            group = heads // kv_heads
            hf_scores = (hf_q * hf_k.repeat_interleave(group, 0)).sum(-1)
            cpp_scores = (cpp_q * cpp_k.repeat_interleave(group, 0)).sum(-1)
            torch.testing.assert_close(cpp_scores, hf_scores, rtol=1e-9, atol=1e-9)


def test_experts_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="dense models; this one has experts"):
        write_llama_gguf(tmp_path / "m.gguf", {"num_local_experts": 8}, {})


NO_BINDING = ("the llama.cpp binding (llama-cpp-python, an optional benchmark contender) is not "
              "installed; the GGUF layout it would read is checked without it")


def test_without_the_binding_the_benchmark_leaves_llamacpp_out_with_a_note(capsys, monkeypatch):
    from forwardkit.bench import generation_cli, llamacpp

    monkeypatch.setattr(llamacpp, "llamacpp_available", lambda: False)  # as where it is absent
    names = ["forwardkit", "llama.cpp"]
    assert generation_cli._with_llamacpp(names, explicit=False) == ["forwardkit"]
    assert "pip install llama-cpp-python" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--contenders llama.cpp: llama.cpp contender skipped"):
        generation_cli._with_llamacpp(names, explicit=True)
    assert "about 6 minutes" in llamacpp_missing_note()


@pytest.mark.skipif(not llamacpp_available(), reason=NO_BINDING)
@pytest.mark.parametrize("model", ["llm", "scaled_llm", "biased_llm"])
def test_llamacpp_generates_forwardkits_tokens(model, request):
    llm = request.getfixturevalue(model)
    from forwardkit.bench.generation_cli import _with_llamacpp
    from forwardkit.bench.llamacpp import LlamaCppGenerator

    names = ["forwardkit", "llama.cpp"]
    assert _with_llamacpp(names, explicit=True) == names
    prompts = [[5, 17, 300, 42, 8], [9, 10, 11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [list(o.outputs[0].token_ids)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    cpp = LlamaCppGenerator(llm.runner.model_config.hf_config, hf_state_dict(llm.runner.model),
                            max_seqs=2, max_len=16, threads=1)
    try:
        assert cpp.generate(prompts, 6) == want
        assert cpp.generate(prompts[:1], 6) == want[:1]  # a fresh cache per call
    finally:
        cpp.close()


@pytest.fixture(scope="module", params=["q8_0", "q4_0", "q4_1"])
def quant_llm(request):
    """The built-in shape with a whole number of 32-weight blocks in every row, quantized."""
    from forwardkit.config import build_engine_config
    from forwardkit.config.model_shapes import BUILTIN_MODEL_SHAPE, model_shape_config

    hf = {**model_shape_config(BUILTIN_MODEL_SHAPE), "intermediate_size": 704}
    return LLM(engine_config=build_engine_config(default_hf_config=hf, platform="cpu",
                                                 quantization=request.param, **ENGINE), seed=6)


def test_quantized_weights_go_over_as_the_same_blocks(quant_llm, tmp_path):
    """A quantized model's GGUF holds forwardkit's packed blocks under the GGUF type of their
    format, byte for byte (Q/K rows in llama.cpp's order), and ``gguf``'s own dequantization of
    them equals forwardkit's: llama.cpp runs the very bits forwardkit runs."""
    from forwardkit.bench.generation import hf_quant_formats
    from forwardkit.quantization.formats import dequantize

    hf = quant_llm.runner.model_config.hf_config
    model = quant_llm.runner.model
    state, formats = hf_state_dict(model), hf_quant_formats(model)
    fmt = quant_llm.runner.model_config.quantization
    want_type = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
                 "q4_1": gguf.GGMLQuantizationType.Q4_1}[fmt]
    # every linear of every layer in the format (7 a layer), the embedding and head in q8_0
    projections = {n: f for n, f in formats.items() if ".layers." in n}
    assert len(projections) == 7 * hf["num_hidden_layers"] and set(projections.values()) == {fmt}
    assert {formats["model.embed_tokens.weight"], formats["lm_head.weight"]} == {"q8_0"}
    reader = gguf.GGUFReader(write_llama_gguf(tmp_path / "m.gguf", hf, state, formats))
    tensors = {t.name: t for t in reader.tensors}
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    for layer in range(hf["num_hidden_layers"]):
        for hf_leaf, ours, n_heads in (("self_attn.q_proj", "attn_q", heads),
                                       ("self_attn.k_proj", "attn_k", kv_heads),
                                       ("self_attn.v_proj", "attn_v", None),
                                       ("mlp.down_proj", "ffn_down", None)):
            packed = state[f"model.layers.{layer}.{hf_leaf}.weight"]
            t = tensors[f"blk.{layer}.{ours}.weight"]
            assert t.tensor_type == want_type
            rows = packed if n_heads is None else packed[_llamacpp_row_order(packed.shape[0], n_heads)]
            got = torch.from_numpy(t.data.copy()).reshape(rows.shape)
            assert torch.equal(got, rows)
            theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
            assert torch.equal(theirs.reshape(rows.shape[0], -1).float(), dequantize(rows, fmt))


def test_a_crash_of_the_extra_buffers_probe_is_named_and_a_clean_run_is_not(tmp_path):
    """The child that tries llama.cpp's extra buffer types: its death by a signal is reported by
    the signal's name; a run that exits (even with an error status) is not a crash."""
    from forwardkit.bench.llamacpp import extra_buffers_crash

    dies = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert extra_buffers_crash(str(tmp_path / "a.gguf"), 2, dies) == (
        "a child process running it with them died by SIGSEGV")
    assert extra_buffers_crash(str(tmp_path / "a.gguf"), 2, "import sys; sys.exit(5)") is None
    assert extra_buffers_crash(str(tmp_path / "a.gguf"), 2, "pass") is None


def test_only_a_gguf_with_block_quantized_tensors_is_probed(llm, quant_llm, tmp_path):
    """llama.cpp's extra buffer types take block-quantized tensors only: a bf16 / float32 GGUF
    skips the probe's child process (seconds of loading), a q4_0 one is probed."""
    from forwardkit.bench.generation import hf_quant_formats
    from forwardkit.bench.llamacpp import holds_block_quantized

    plain = write_llama_gguf(tmp_path / "plain.gguf", llm.runner.model_config.hf_config,
                             hf_state_dict(llm.runner.model))
    assert not holds_block_quantized(str(plain))
    model = quant_llm.runner.model
    packed = write_llama_gguf(tmp_path / "q.gguf", quant_llm.runner.model_config.hf_config,
                              hf_state_dict(model), hf_quant_formats(model))
    assert holds_block_quantized(str(packed))


@pytest.mark.skipif(not llamacpp_available(), reason=NO_BINDING)
def test_a_plain_gguf_loads_without_the_probe(llm, monkeypatch):
    from forwardkit.bench import llamacpp

    def probe(path: str, threads: int) -> str | None:
        raise AssertionError("the probe ran for a GGUF without block-quantized tensors")

    monkeypatch.setattr(llamacpp, "extra_buffers_crash", probe)
    cpp = llamacpp.LlamaCppGenerator(llm.runner.model_config.hf_config,
                                     hf_state_dict(llm.runner.model), max_seqs=1, max_len=12,
                                     threads=1)
    try:
        assert cpp.extra_buffers_off is None and cpp.probe_seconds == 0.0
        assert len(cpp.generate([[5, 17, 300, 42]], 3)[0]) == 3
    finally:
        cpp.close()


@pytest.mark.skipif(not llamacpp_available(), reason=NO_BINDING)
def test_after_a_probe_crash_llamacpp_runs_without_extra_buffers(quant_llm, monkeypatch,
                                                                 fk_log_records):
    """Where the probe child crashed, the generator loads with llama.cpp's extra buffer types
    off, says why in a logged warning, and still generates."""
    from forwardkit.bench import llamacpp
    from forwardkit.bench.generation import hf_quant_formats

    monkeypatch.setattr(llamacpp, "extra_buffers_crash",
                        lambda path, threads: "a child process running it with them died by X")
    model = quant_llm.runner.model
    cpp = llamacpp.LlamaCppGenerator(quant_llm.runner.model_config.hf_config,
                                     hf_state_dict(model), max_seqs=1, max_len=12, threads=1,
                                     formats=hf_quant_formats(model))
    try:
        assert cpp.extra_buffers_off == "a child process running it with them died by X"
        assert len(cpp.generate([[5, 17, 300, 42]], 3)[0]) == 3
    finally:
        cpp.close()
    assert any("runs without its extra buffer types" in r.getMessage() for r in fk_log_records)


def test_a_format_gguf_lacks_is_refused_by_name(llm, tmp_path):
    hf = llm.runner.model_config.hf_config
    state = hf_state_dict(llm.runner.model)
    with pytest.raises(ValueError, match=r"no GGUF type for .*'q3_x'.*accepted formats"):
        write_llama_gguf(tmp_path / "m.gguf", hf, state, {"model.norm.weight": "q3_x"})


@pytest.mark.skipif(not llamacpp_available(), reason=NO_BINDING)
def test_llamacpp_agrees_with_forwardkit_on_the_same_quantized_bits(quant_llm):
    """llama.cpp on forwardkit's exported blocks: next-token log-probabilities after every
    prefix of a 16-token sequence within 0.035 nats of forwardkit's. Measured: 0.019-0.020 on
    this small-weight model, 0.059-0.062 with the Q/K rows left in forwardkit's order (its
    attention is nearly uniform, so a wrong order moves little; the bytes themselves are
    checked above). Both engines round activations to int8 blocks, not identically, and this
    model's top tokens lie within 0.1 nats, so exact greedy equality would be luck."""
    from forwardkit.bench.generation import hf_quant_formats
    from forwardkit.bench.llamacpp import LlamaCppGenerator

    tokens = [5, 17, 300, 42, 8, 9, 10, 11, 12, 13, 700, 1, 2, 3, 4, 99]
    vocab = quant_llm.runner.model_config.hf_config["vocab_size"]
    kept: dict[int, torch.Tensor] = {}
    from forwardkit.engine import llm as llm_module

    original = llm_module.record_prompt_logprobs

    def keep(logits, plan):  # the full distributions the engine computed for the prompt
        rows = torch.log_softmax(logits.double(), dim=-1)
        for i, (_, pos) in enumerate(plan.targets):
            kept[pos] = rows[i]
        original(logits, plan)

    llm_module.record_prompt_logprobs = keep
    try:
        quant_llm.generate(prompt_token_ids=[tokens], sampling_params=SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    finally:
        llm_module.record_prompt_logprobs = original
    ours = torch.stack([kept[p] for p in range(1, len(tokens))])
    model = quant_llm.runner.model
    cpp = LlamaCppGenerator(quant_llm.runner.model_config.hf_config, hf_state_dict(model),
                            max_seqs=1, max_len=len(tokens) + 1, threads=1,
                            formats=hf_quant_formats(model))
    try:
        theirs = torch.log_softmax(cpp.logits([(t, p, 0, True) for p, t in enumerate(tokens)])
                                   .double(), dim=-1)
    finally:
        cpp.close()
    assert ours.shape == (len(tokens) - 1, vocab)
    assert (ours - theirs[:-1]).abs().max().item() < 0.035


def test_bandwidth_use_counts_the_packed_bytes_a_step_reads(quant_llm):
    """The bench's bytes per decode step for a quantized model are its packed projections'
    block bytes plus the LM head, not the shape's dtype bytes."""
    from forwardkit.bench.generation_cli import _packed_step_bytes
    from forwardkit.config.model_shapes import weight_bytes_per_token
    from forwardkit.quantization.formats import get_format

    hf = quant_llm.runner.model_config.hf_config
    fmt = get_format(quant_llm.runner.model_config.quantization)
    hidden, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    heads, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    weights = layers * (hidden * (heads + 2 * kv) * d + heads * d * hidden + 3 * hidden * inter)
    head = hf["vocab_size"] * hidden // 32 * 34  # q8_0; the untied embedding table is not read
    norms = (2 * layers + 1) * hidden * 4
    assert not hf["tie_word_embeddings"]
    want = weights // 32 * fmt.block_bytes + head + norms
    assert _packed_step_bytes({"forwardkit": quant_llm}, hf) == want
    assert want < weight_bytes_per_token(hf, 4)
