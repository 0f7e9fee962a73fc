"""Write a Llama-family model's weights as a GGUF file, for llama.cpp to run the same tensors.

The benchmark's llama.cpp contender needs the very weights forwardkit runs. This writes them
with the ``gguf`` package under llama.cpp's ``llama`` architecture names:

- ``token_embd``, ``output_norm``, ``output`` (left out when the embedding is tied), and per
  layer ``attn_norm``, ``attn_q/k/v``, ``attn_output``, ``ffn_norm``, ``ffn_gate/up/down``,
  and the attention biases where the model has them (Llama's ``attention_bias``, Qwen2's
  q/k/v biases) as ``attn_q/k/v/output.bias``;
- Q and K rows (and their biases' entries) are permuted from Hugging Face's rotary layout (the two halves of each head)
  to the interleaved pairs llama.cpp's ``llama`` rotary expects, per head:
  ``w.view(heads, 2, head_dim // 2, in).transpose(1, 2)``;
- a scaled rotary (``llama3``, ``linear``) as the ``rope_freqs`` tensor of per-frequency
  divisors, taken from forwardkit's own rotary tables;
- no vocabulary (tokenizer model ``no_vocab``): the benchmark feeds token ids.

bf16 tensors are stored as BF16, float32 as F32, float16 as F16, so both engines read the
same number of bytes per step. Block-quantized weights (``formats`` names their format:
``q8_0``, ``q4_0``, ``q4_1``) are forwardkit's packed ``uint8`` rows, which hold ggml's block
bytes: they are written as GGUF ``Q8_0`` / ``Q4_0`` / ``Q4_1`` as they are, never requantized,
so llama.cpp runs the very bits forwardkit runs (the rotary permutation moves whole rows).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["gguf_available", "write_llama_gguf"]


def gguf_available() -> bool:
    """Whether the ``gguf`` package is importable."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return True


def _rotary_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Q or K projection from the half-split rotary layout to interleaved pairs."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_factors(hf_config: Mapping[str, Any], head_dim: int) -> tuple[float, torch.Tensor | None]:
    """(rope base, per-frequency divisors or None): a scaled rotary (``llama3``, ``linear``)
    goes to llama.cpp as the ``rope_freqs`` tensor, plain frequency / scaled frequency, from
    forwardkit's own rotary tables so both engines rotate alike."""
    from forwardkit.config.model import rope_parameters
    from forwardkit.layers.rotary_embedding import _default_inv_freq, _llama3_inv_freq

    theta, scaling = rope_parameters(dict(hf_config))
    if scaling is None:
        return theta, None
    plain = _default_inv_freq(theta, head_dim)
    if scaling["rope_type"] == "llama3":
        scaled = _llama3_inv_freq(plain, scaling)
    elif scaling["rope_type"] == "linear":
        scaled = plain / float(scaling["factor"])
    else:
        raise ValueError(f"the GGUF export writes rope_type 'llama3' or 'linear', not "
                         f"{scaling['rope_type']!r}")
    return theta, (plain / scaled).float().contiguous()


def _gguf_names(layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                 "self_attn.v_proj.weight": "attn_v.weight",
                 "self_attn.o_proj.weight": "attn_output.weight",
                 "post_attention_layernorm.weight": "ffn_norm.weight",
                 "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                 "mlp.down_proj.weight": "ffn_down.weight",
                 # Llama's attention_bias / Qwen2's q/k/v biases: llama.cpp's llama
                 # architecture adds them when present
                 "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.bias": "attn_output.bias"}
    for i in range(layers):
        for hf, ours in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{ours}"
    return names


def write_llama_gguf(path: str | os.PathLike[str], hf_config: Mapping[str, Any],
                     state: Mapping[str, torch.Tensor],
                     formats: Mapping[str, str] | None = None) -> str:
    """Write ``state`` (Hugging Face names, a Llama-family model of ``hf_config``) to ``path``
    as a GGUF file llama.cpp loads; returns the path. ``formats`` maps the names whose tensor
    is a packed block-quantized ``uint8`` weight to its format (``q8_0``, ``q4_0``, ``q4_1``).
    Raises ``ValueError`` for a model this cannot express (mixture of experts, other rope
    types, names it does not know, a format GGUF has no type for here); attention biases
    (Llama's ``attention_bias``, Qwen2's q/k/v) are written."""
    import gguf
    import numpy as np

    if hf_config.get("num_local_experts"):
        raise ValueError("the GGUF export covers Llama-family dense models; this one has experts")
    layers = int(hf_config["num_hidden_layers"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    hidden = int(hf_config["hidden_size"])
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    names = _gguf_names(layers)
    tied = bool(hf_config.get("tie_word_embeddings", False))
    unknown = sorted(n for n in state if n not in names)
    if unknown:
        raise ValueError(f"no GGUF name for {unknown[:5]} (only the Llama-family tensors and "
                         "attention biases are written)")
    kinds = {torch.bfloat16: gguf.GGMLQuantizationType.BF16,
             torch.float16: gguf.GGMLQuantizationType.F16,
             torch.float32: gguf.GGMLQuantizationType.F32}
    block_kinds = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
                   "q4_1": gguf.GGMLQuantizationType.Q4_1}
    formats = dict(formats or {})
    strange = sorted(f"{n}: {f!r}" for n, f in formats.items() if f not in block_kinds)
    if strange:
        raise ValueError(f"no GGUF type for {strange[:3]} (accepted formats: {sorted(block_kinds)})")
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    writer.add_context_length(int(hf_config.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(hf_config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    theta, factors = _rope_factors(hf_config, head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(hf_config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(hf_config["vocab_size"]))
    writer.add_tokenizer_model("no_vocab")
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        t = tensor.detach().to("cpu").contiguous()
        if hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            # a bias's entries follow its projection's rows into llama.cpp's rotary order
            rows = t.reshape(t.shape[0], -1)
            t = _rotary_interleaved(rows, heads if ".q_proj." in hf_name else kv_heads).reshape(t.shape)
        fmt = formats.get(hf_name)
        if fmt is not None:
            if t.dtype != torch.uint8 or t.dim() != 2:
                raise ValueError(f"{hf_name}: a {fmt} weight is packed uint8 rows, got "
                                 f"{t.dtype} of shape {tuple(t.shape)}")
            # the packed bytes as they are; the GGUF shape is derived from the byte shape
            writer.add_tensor(names[hf_name], t.numpy(), raw_dtype=block_kinds[fmt])
            continue
        if t.dtype not in kinds:
            raise ValueError(f"{hf_name}: dtype {t.dtype} has no GGUF type here "
                             f"(accepted: {sorted(str(d) for d in kinds)})")
        kind = kinds[t.dtype]
        if t.dim() == 1:  # llama.cpp computes norms and bias additions in float32
            t, kind = t.float(), gguf.GGMLQuantizationType.F32
        if t.dtype == torch.bfloat16:
            array = t.view(torch.int16).numpy().view(np.uint16)
        else:
            array = t.numpy()
        writer.add_tensor(names[hf_name], array, raw_shape=list(t.shape), raw_dtype=kind)
    if factors is not None:  # llama.cpp divides each rotary frequency by its factor
        writer.add_tensor("rope_freqs.weight", factors.numpy(), raw_shape=list(factors.shape),
                          raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(path)
