"""Writing tiny GGUF files for the tests: a Hugging Face model's tensors under llama.cpp's names
(Q/K rows permuted as llama.cpp's converter does for a ``llama`` file), each in a chosen type:
float types as they are, Q8_0 / Q4_0 / Q4_1 quantized by the ``gguf`` package, Q4_K / Q6_K as
random valid blocks (the ``gguf`` package cannot quantize those)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
}
K_BLOCK = {T.Q4_K: (144, (0, 2)), T.Q6_K: (210, (208,))}  # bytes a block, fp16 offsets in it


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: each head's two halves interleaved in pairs."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(state: dict[str, torch.Tensor], cfg: dict[str, Any], arch: str) -> dict[str, np.ndarray]:
    """The model's tensors as float32 arrays under GGUF names (Q/K permuted for ``llama``)."""
    out: dict[str, np.ndarray] = {}
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter = cfg["intermediate_size"]
    for name, t in state.items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            if not cfg.get("tie_word_embeddings"):
                out["output.weight"] = a
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            if rest == "mlp.experts.gate_up_proj":
                out[f"blk.{layer}.ffn_gate_exps.weight"] = a[:, :inter]
                out[f"blk.{layer}.ffn_up_exps.weight"] = a[:, inter:]
                continue
            if rest == "mlp.experts.down_proj":
                out[f"blk.{layer}.ffn_down_exps.weight"] = a
                continue
            gname = PER_LAYER[rest]
            if arch == "llama" and gname.startswith(("attn_q.", "attn_k.")):
                a = llamacpp_permute(a, heads if gname.startswith("attn_q.") else kv)
            out[f"blk.{layer}.{gname}"] = a
    return out


def random_k_blocks(kind: T, rows: int, k: int, seed: int) -> np.ndarray:
    """``[rows, k / 256 * block bytes]`` random valid Q4_K / Q6_K bytes (small finite scales)."""
    size, offsets = K_BLOCK[kind]
    rng = np.random.default_rng(seed)
    n = rows * k // 256
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in offsets:
        scale = rng.uniform(0.0005, 0.004, n).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def write_gguf(path: str, arch: str, cfg: dict[str, Any], tensors: dict[str, np.ndarray],
               type_of: Callable[[str, np.ndarray], T] = lambda name, a: T.F32,
               metadata: Callable[[gguf.GGUFWriter], None] | None = None) -> str:
    """Write ``tensors`` (float32, or already packed uint8 bytes with the type ``type_of``
    gives) and the model's metadata (``metadata`` writes more keys, and the vocabulary: without
    it the file says ``no_vocab``); returns ``path``."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(int(cfg.get("max_position_embeddings", 256)))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("num_local_experts"):
        writer.add_expert_count(cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if metadata is not None:
        metadata(writer)  # it may write a vocabulary
    else:
        writer.add_tokenizer_model("no_vocab")
    for name, a in tensors.items():
        kind = type_of(name, a)
        if a.dtype == np.uint8:  # already packed bytes
            writer.add_tensor(name, a, raw_dtype=kind)
        elif a.ndim == 1 or kind == T.F32:
            writer.add_tensor(name, a.astype(np.float32))
        elif kind == T.F16:
            writer.add_tensor(name, a.astype(np.float16))
        elif kind == T.BF16:
            writer.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), T.BF16), raw_dtype=T.BF16)
        else:
            writer.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bpe_vocabulary(texts: list[str], size: int = 300) -> tuple[Any, Callable[[gguf.GGUFWriter], None]]:
    """A byte-level BPE tokenizer trained on ``texts`` and the metadata writer that stores it as
    a GGUF ``gpt2`` vocabulary (tokens, merges, ``<s>`` = 0, ``</s>`` = 1)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())["model"]
    tokens = [""] * len(spec["vocab"])
    for text, index in spec["vocab"].items():
        tokens[index] = text
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * len(tokens))
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)

    return tok, write
