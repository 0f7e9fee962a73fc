"""The token embedding and the LM head of a model quantized on load are held in ``q8_0``: the
lookup (``forwardkit::quant_embedding``) gives the rows of the dequantized table bit for bit, a
tied head shares the one packed table, the tokens are those of the same model holding the
dequantized values, and the resident bytes are what the formats say."""

from __future__ import annotations

import pytest
import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.config.model import EMBEDDING_QUANTIZATION, embedding_quantization
from forwardkit.engine.llm import LLM
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.engine.tp import weight_bytes
from forwardkit.layers.linear import LMHead, VocabEmbedding, quantized_linears
from forwardkit.models.loader import load_model
from forwardkit.quantization.formats import FORMATS, dequantize, packed_shape, quantize
from forwardkit.quantization.linear_method import QuantizedEmbeddingMethod

from .conftest import TINY, _tiny_llama, dequantize_like_load  # noqa: TID252

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 120, 3]]


@pytest.fixture(params=["native", "torch"])
def lookup_path(request, monkeypatch):
    """The op's two dequantization paths: the native build's and the torch one."""
    from forwardkit.kernels.cpu import native_quant

    native_quant.cache_clear()
    if request.param == "torch":
        monkeypatch.setenv("FORWARDKIT_CPU_NATIVE_LINEAR", "0")
    else:
        assert native_quant.available()  # the generic build runs on every CPU
    yield request.param
    monkeypatch.undo()
    native_quant.cache_clear()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_equals_dequantize_then_index(fmt, dtype, lookup_path):
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(200, 96, generator=gen) * torch.logspace(-3, 1, 200).unsqueeze(1)
    packed = quantize(table, fmt)
    ids = torch.tensor([[0, 199, 7, 7], [150, 3, 0, 64]])  # repeats, both ends, 2-D
    got = torch.ops.forwardkit.quant_embedding(ids, packed, fmt, dtype)
    want = dequantize(packed, fmt, dtype)[ids]
    assert got.dtype == dtype and got.shape == (2, 4, 96)
    assert torch.equal(got, want)


def test_quant_embedding_is_one_node_of_a_dynamo_graph(forwardkit_ops):
    layer = VocabEmbedding(200, 64, torch.float32, quant_method=QuantizedEmbeddingMethod("q8_0"))
    with torch.no_grad():
        layer.weight.normal_()
    layer.quant_method.process_weights_after_loading(layer, "w")
    ids = torch.tensor([3, 1, 199])
    out, ops = forwardkit_ops(layer, ids)
    assert torch.equal(out, layer(ids))
    assert ops == ["forwardkit.quant_embedding"]


def test_embedding_rule_is_q8_0_for_every_format():
    assert EMBEDDING_QUANTIZATION == "q8_0"
    assert [embedding_quantization(f) for f in (None, "q8_0", "q4_0", "q4_1")] == [None, "q8_0", "q8_0", "q8_0"]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture
def reference_path(monkeypatch):
    """Quantized weights by dequantize-then-matmul (the native kernels off): a packed model then
    computes what a dense model holding the dequantized values computes."""
    from forwardkit.kernels.cpu import native_quant

    native_quant.cache_clear()
    monkeypatch.setenv("FORWARDKIT_CPU_NATIVE_LINEAR", "0")
    yield
    monkeypatch.undo()
    native_quant.cache_clear()


def test_tied_head_shares_the_packed_table_and_gives_the_dequantized_tokens(tmp_path, reference_path):
    model = _tiny_llama(tie_word_embeddings=True)
    model.save_pretrained(str(tmp_path / "tied"))
    dequantize_like_load(model, "q4_0")
    model.save_pretrained(str(tmp_path / "deq"))
    quant = LLM(model=str(tmp_path / "tied"), quantization="q4_0", enforce_eager=True)
    module = quant.runner.module
    embed, head = module.model.embed_tokens, module.lm_head
    assert head.tied and head.weight is embed.weight  # one packed table, not two
    assert embed.weight.dtype == torch.uint8
    assert embed.quant_method.format.name == head.quant_method.format.name == "q8_0"
    assert weight_bytes(module) == _expected_bytes(module, "q4_0", tied=True)
    reference = LLM(model=str(tmp_path / "deq"), enforce_eager=True)
    assert _greedy(quant) == _greedy(reference)


def test_seeded_random_tied_model_packs_the_table_once():
    """No checkpoint: the seeded fill, then one packed table shared by the embedding and head."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY,
          "tie_word_embeddings": True, "torch_dtype": "float32"}
    model = load_model(build_engine_config(None, default_hf_config=hf, quantization="q4_1",
                                           enforce_eager=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.uint8
    assert weight_bytes(model) == _expected_bytes(model, "q4_1", tied=True)


def _expected_bytes(module: torch.nn.Module, fmt: str, tied: bool) -> int:
    """Resident weight bytes of the tiny Llama from the formats: packed projections, one q8_0
    table (two when the head is untied), float32 norms."""
    hidden, inter, vocab = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    head_dim = hidden // TINY["num_attention_heads"]
    qkv = (TINY["num_attention_heads"] + 2 * TINY["num_key_value_heads"]) * head_dim
    shapes = [(qkv, hidden), (hidden, TINY["num_attention_heads"] * head_dim), (2 * inter, hidden),
              (hidden, inter)]
    layers = TINY["num_hidden_layers"]
    projections = layers * sum(r * b for r, b in (packed_shape(fmt, *s) for s in shapes))
    rows, row_bytes = packed_shape("q8_0", vocab, hidden)
    tables = rows * row_bytes * (1 if tied else 2)
    norms = (2 * layers + 1) * hidden * 4
    return projections + tables + norms


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_resident_bytes_are_what_the_formats_say(llama_dir, fmt):
    cfg = build_engine_config(llama_dir, quantization=fmt, enforce_eager=True)
    model = load_model(cfg)
    assert len(quantized_linears(model)) == 8
    tables = [m for m in model.modules() if isinstance(m, (VocabEmbedding, LMHead))]
    assert all(m.weight.dtype == torch.uint8 for m in tables)
    assert weight_bytes(model) == _expected_bytes(model, fmt, tied=False)


def test_two_tp_ranks_give_the_one_rank_tokens(tmp_path, reference_path):
    """The q8_0 embedding and head split by vocabulary rows over two ranks (each rank's lookup
    masked to its rows, the head's logits gathered) give the one-rank model's tokens."""
    _tiny_llama(intermediate_size=128).save_pretrained(str(tmp_path))  # 64 a rank: whole blocks
    one = LLM(model=str(tmp_path), quantization="q4_0", enforce_eager=True)
    two = LLM(model=str(tmp_path), quantization="q4_0", enforce_eager=True, tensor_parallel_size=2)
    assert two.runner.module.model.embed_tokens.weight.dtype == torch.uint8
    assert _greedy(two) == _greedy(one)
