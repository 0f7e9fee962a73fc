"""Bad GGUF input is refused by name before any tensor is read: a tensor type forwardkit lacks,
an architecture it lacks, a truncated or corrupt file, a shape or a tensor set that disagrees
with the metadata, a tensor-parallel size that cuts a 32-weight block; and a GGUF model split
over two TP ranks generates the one-rank tokens."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from forwardkit.config.builder import build_engine_config
from forwardkit.engine.llm import LLM
from forwardkit.engine.sampling_params import SamplingParams
from forwardkit.models import gguf_loader

from .gguf_files import gguf_tensors, write_gguf  # noqa: TID252

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
T = gguf.GGMLQuantizationType

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _tensors(cfg: dict = TINY) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    hf = transformers.LlamaConfig(**cfg, initializer_range=0.2)
    return gguf_tensors(transformers.LlamaForCausalLM(hf).state_dict(), cfg, "llama")


def _q8(name: str, a: np.ndarray):
    return T.Q8_0 if name.split(".")[-2] in PROJ else T.F32


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Names of the tensors whose data the loader reads."""
    seen: list[str] = []
    real = gguf_loader._raw

    def counting(tensor):
        seen.append(tensor.name)
        return real(tensor)

    monkeypatch.setattr(gguf_loader, "_raw", counting)
    return seen


def test_unsupported_tensor_type_is_named_with_the_tensor(tmp_path, reads):
    tensors = _tensors()
    rows, k = tensors["blk.1.attn_q.weight"].shape
    # Q5_0 (blocks of 32 weights, 22 bytes): a type forwardkit does not read
    tensors["blk.1.attn_q.weight"] = np.zeros((rows, k // 32 * 22), dtype=np.uint8)
    path = write_gguf(str(tmp_path / "q5.gguf"), "llama", TINY, tensors,
                      type_of=lambda name, a: T.Q5_0 if name == "blk.1.attn_q.weight" else T.F32)
    with pytest.raises(ValueError, match=r"tensor 'blk\.1\.attn_q\.weight' has type Q5_0, which "
                                         r"forwardkit does not read; supported: .*Q4_K"):
        LLM(model=path, enforce_eager=True)
    assert reads == []  # refused before any tensor was read


def test_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(str(tmp_path / "gpt2.gguf"), "gpt2", TINY, _tensors())
    with pytest.raises(ValueError, match=r"architecture 'gpt2' \(general.architecture\) is not "
                                         r"supported; supported: \['llama', 'qwen2'\]"):
        LLM(model=path, enforce_eager=True)


def test_truncated_file_is_named(tmp_path):
    path = write_gguf(str(tmp_path / "t.gguf"), "llama", TINY, _tensors(), type_of=_q8)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=r"t\.gguf.*(truncated)"):
        LLM(model=path, enforce_eager=True)


def test_corrupt_header_is_named(tmp_path):
    path = write_gguf(str(tmp_path / "c.gguf"), "llama", TINY, _tensors())
    with open(path, "r+b") as f:
        f.write(b"GGXX")
    with pytest.raises(ValueError, match=r"cannot read GGUF file .*c\.gguf.*truncated, corrupt or "
                                         r"not a GGUF file"):
        LLM(model=path, enforce_eager=True)


def test_shape_that_disagrees_with_the_metadata_is_named(tmp_path, reads):
    tensors = _tensors()
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"][:64]
    path = write_gguf(str(tmp_path / "s.gguf"), "llama", TINY, tensors, type_of=_q8)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_up\.weight' has shape \(64, 64\), "
                                         r"the metadata gives \(96, 64\)"):
        LLM(model=path, enforce_eager=True)
    assert reads == []


def test_missing_and_unknown_tensors_are_named(tmp_path, reads):
    tensors = _tensors()
    del tensors["blk.1.ffn_down.weight"]
    tensors["blk.0.attn_extra.weight"] = np.zeros((4, 64), dtype=np.float32)
    path = write_gguf(str(tmp_path / "m.gguf"), "llama", TINY, tensors)
    with pytest.raises(ValueError) as info:
        LLM(model=path, enforce_eager=True)
    assert "tensor 'blk.0.attn_extra.weight': not a tensor of this llama model" in str(info.value)
    assert "missing: blk.1.ffn_down.weight" in str(info.value)
    assert reads == []


def test_tp_size_that_cuts_a_block_is_refused(tmp_path):
    """intermediate_size 96 over 2 ranks: 48 inputs of ffn_down each, not whole 32-blocks."""
    path = write_gguf(str(tmp_path / "q8.gguf"), "llama", TINY, _tensors(), type_of=_q8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 cuts the 32-weight blocks of "
                                         r"the packed ffn_down weights .* 48 of its "
                                         r"intermediate_size=96 inputs"):
        build_engine_config(path, tensor_parallel_size=2)
    # the same file with float projections splits fine (no blocks to cut)
    dense = write_gguf(str(tmp_path / "f32.gguf"), "llama", TINY, _tensors())
    assert build_engine_config(dense, tensor_parallel_size=2).parallel_config.tensor_parallel_size == 2


def test_quantization_argument_is_refused_for_a_gguf(tmp_path):
    path = write_gguf(str(tmp_path / "f.gguf"), "llama", TINY, _tensors())
    with pytest.raises(ValueError, match="GGUF file .* keeps the types its tensors have"):
        build_engine_config(path, quantization="q8_0")


@pytest.mark.distributed
@pytest.mark.parametrize("tied", [False, True])
def test_packed_gguf_over_two_tp_ranks_generates_the_one_rank_tokens(tmp_path, tied):
    """Column splits take rows, row splits whole blocks, the packed head and the packed
    embedding (one table when tied) their vocabulary rows."""
    cfg = dict(TINY, intermediate_size=128, tie_word_embeddings=tied)
    tensors = {k: v for k, v in _tensors(cfg).items() if not (tied and k == "output.weight")}
    tables = ("output.weight", "token_embd.weight")
    path = write_gguf(str(tmp_path / "tp.gguf"), "llama", cfg, tensors,
                      type_of=lambda name, a: T.Q8_0 if name in tables else _q8(name, a))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 90, 41], [7, 7, 120, 3]]

    def tokens(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    one = tokens(LLM(model=path, dtype="float32", enforce_eager=True))
    two = LLM(model=path, dtype="float32", enforce_eager=True, tensor_parallel_size=2)
    try:
        assert tokens(two) == one
    finally:
        two.shutdown()


def test_missing_model_path_names_both_accepted_kinds(tmp_path):
    with pytest.raises(ValueError, match=r"model path .*absent\.gguf.* is not a directory "
                                         r"\(expected a local Hugging Face checkpoint with "
                                         r"config\.json, or a GGUF file\)"):
        build_engine_config(str(tmp_path / "absent.gguf"))
