"""Load a GGUF file's tensors into a model built from its metadata (``config/gguf.py``).

Every tensor is checked before any is read: its name (llama.cpp's ``llama`` / ``qwen2`` names),
its type (:mod:`~forwardkit.quantization.gguf_types`), its shape against the metadata, and that
no tensor the model needs is absent; one ``ValueError`` names every problem.

Then, tensor by tensor:

* the attention and MLP projections (``attn_q/k/v/output``, ``ffn_gate/up/down``), the LM
  head (``output``) and the token embedding (``token_embd``) in a quantized type stay packed:
  Q8_0 / Q4_0 / Q4_1 as their own bytes, Q4_K repacked into ``q4_1``, Q6_K into ``q8_0``. A
  projection gets the packed weight and the quant method that applies it through
  ``forwardkit::quant_linear`` (``quantization.linear_method.install_packed_weight``); the parts
  of a merged projection (q/k/v, gate/up) in different formats run as one op call per part. The
  embedding gets its packed table, looked up through ``forwardkit::quant_embedding`` (which
  dequantizes only the rows it gathers), and a head tied to it shares that table
  (``install_packed_table``), as a model quantized on load does;
* stacked MoE expert tensors in such a type stay packed in their layer
  (``FusedMoE.install_packed``): gate and up as one ``w13`` when both map to the same format
  (else both are dequantized), down on its own, this rank's experts and intermediate slice;
* everything else (F32 / F16 / BF16 tensors, norms, biases, the MoE router) is dequantized to
  float32 values (ggml's,
  bit for bit) and copied in the model's dtype through the models' own ``load_weights``;
* Q and K rows (and their biases) of a ``llama`` file go back from llama.cpp's interleaved rotary
  order to the half-split order of the Hugging Face checkpoint its converter read (a ``qwen2``
  file is stored unpermuted).

Tensor parallelism takes each rank's rows of a packed column-parallel weight, and its columns
of a row-parallel one cut at 32-weight block boundaries (the config refuses a TP size that cuts a
block). Loads of more than :data:`PROGRESS_MIN_BYTES` log their progress every 10 %.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from forwardkit.config.gguf import GGUFFile, GGUFTensor, open_gguf
from forwardkit.kernels.cpu import hugepages
from forwardkit.layers.fused_moe import FusedMoE
from forwardkit.layers.linear import Linear, LMHead, MergedLinear
from forwardkit.layers.parallel import shard_spec_of
from forwardkit.logger import init_logger
from forwardkit.models.llama import LlamaForCausalLM
from forwardkit.quantization import gguf_types
from forwardkit.quantization.formats import BLOCK, dequantize, get_format
from forwardkit.quantization.linear_method import install_packed_table, install_packed_weight

__all__ = ["GGUFLoadError", "PROGRESS_MIN_BYTES", "gguf_tensor_plan", "load_gguf_weights"]

logger = init_logger(__name__)

PROGRESS_MIN_BYTES = 256 << 20  # smaller files load without progress lines
_CHUNK_WEIGHTS = 1 << 22  # weights dequantized at once (bounds the float32 temporaries)

_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
_EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
_PROJECTIONS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


class GGUFLoadError(ValueError):
    """A GGUF file's tensors do not fit the model: every problem found, one per line."""


@dataclass(frozen=True)
class TensorPlan:
    """How one GGUF tensor loads: the Hugging Face name(s) it fills, whether it stays packed
    (its forwardkit format) and the rotary heads to un-permute its rows by (0: none)."""

    tensor: GGUFTensor
    type_name: str
    hf_name: str
    packed_format: str | None
    rotary_heads: int
    expert_kind: str | None = None  # "w1" / "w2" / "w3" for a stacked expert tensor


def _expected_shapes(cfg: dict[str, object], arch: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``(shape of each tensor name, names that may be absent)`` from the model config."""
    def get(key: str) -> int:
        value = cfg[key]
        assert isinstance(value, int)
        return value

    hidden, inter, vocab = get("hidden_size"), get("intermediate_size"), get("vocab_size")
    heads, kv, head_dim = get("num_attention_heads"), get("num_key_value_heads"), get("head_dim")
    q, kvd = heads * head_dim, kv * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
        "output_norm.weight": (hidden,), "rope_freqs.weight": (head_dim // 2,)}
    optional = {"output.weight", "rope_freqs.weight"}
    experts = int(cfg.get("num_local_experts") or 0)  # type: ignore[call-overload]
    for i in range(get("num_hidden_layers")):
        layer = {"attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
                 "attn_q.weight": (q, hidden), "attn_k.weight": (kvd, hidden),
                 "attn_v.weight": (kvd, hidden), "attn_output.weight": (hidden, q),
                 "attn_q.bias": (q,), "attn_k.bias": (kvd,), "attn_v.bias": (kvd,),
                 "attn_output.bias": (hidden,)}
        if experts:
            layer.update({"ffn_gate_inp.weight": (experts, hidden),
                          "ffn_gate_exps.weight": (experts, inter, hidden),
                          "ffn_up_exps.weight": (experts, inter, hidden),
                          "ffn_down_exps.weight": (experts, hidden, inter)})
        else:
            layer.update({"ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
                          "ffn_down.weight": (hidden, inter)})
        for name, shape in layer.items():
            shapes[f"blk.{i}.{name}"] = shape
        biased = arch == "qwen2"
        for name in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"):
            if not biased or name == "attn_output.bias":
                optional.add(f"blk.{i}.{name}")
    return shapes, optional


def _hf_name(gguf_name: str) -> tuple[str, str | None] | None:
    """``(Hugging Face name, expert kind)`` of a GGUF tensor name; None for an unknown name."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name], None
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, rest = parts[1], parts[2]
    if rest in _PER_LAYER:
        return f"model.layers.{layer}.{_PER_LAYER[rest]}", None
    if rest in _EXPERTS:
        return f"model.layers.{layer}.block_sparse_moe.experts", _EXPERTS[rest]
    return None


def gguf_tensor_plan(info: GGUFFile, cfg: dict[str, object]) -> list[TensorPlan]:
    """How each tensor of ``info`` loads into the model of ``cfg`` (module doc); raises
    :class:`GGUFLoadError` listing every unknown name, unsupported type, wrong shape and
    missing tensor before anything is read."""
    arch = info.architecture
    shapes, optional = _expected_shapes(cfg, arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert isinstance(heads, int) and isinstance(kv, int)
    problems: list[str] = []
    plans: list[TensorPlan] = []
    types = {t.name: gguf_types.describe_type(t.type_id) for t in info.tensors}
    for tensor in info.tensors:
        type_name = types[tensor.name]
        want = shapes.get(tensor.name)
        mapped = _hf_name(tensor.name) if tensor.name != "rope_freqs.weight" else None
        if want is None or (mapped is None and tensor.name != "rope_freqs.weight"):
            problems.append(f"tensor {tensor.name!r}: not a tensor of this {arch} model "
                            f"({cfg['architectures']})")
            continue
        if type_name not in gguf_types.SUPPORTED_TYPES:
            problems.append(f"tensor {tensor.name!r} has type {type_name}, which forwardkit does "
                            f"not read; supported: {list(gguf_types.SUPPORTED_TYPES)}")
            continue
        if tensor.shape != want:
            problems.append(f"tensor {tensor.name!r} has shape {tensor.shape}, the metadata gives "
                            f"{want}")
            continue
        per_block, _ = gguf_types.block_geometry(type_name)
        if tensor.shape[-1] % per_block:
            problems.append(f"tensor {tensor.name!r}: rows of {tensor.shape[-1]} weights are not "
                            f"whole {type_name} blocks of {per_block}")
            continue
        if mapped is None:
            continue  # rope_freqs: read into the config's rope_scaling
        hf_name, expert = mapped
        suffix = tensor.name.split(".", 2)[-1]
        packed = None
        if gguf_types.native_format(type_name) is not None and (
                suffix in _PROJECTIONS or tensor.name in ("output.weight", "token_embd.weight")):
            packed = gguf_types.native_format(type_name)
        elif expert is not None:
            packed = _expert_format(tensor.name, types, int(cfg["hidden_size"]))  # type: ignore[call-overload]
        rotary = 0
        if arch == "llama" and suffix in ("attn_q.weight", "attn_q.bias"):
            rotary = heads
        elif arch == "llama" and suffix in ("attn_k.weight", "attn_k.bias"):
            rotary = kv
        plans.append(TensorPlan(tensor, type_name, hf_name, packed, rotary, expert))
    present = info.tensor_names()
    missing = sorted(n for n in shapes if n not in present and n not in optional)
    if missing:
        shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
        problems.append(f"tensors the metadata needs are missing: {shown}")
    if problems:
        raise GGUFLoadError(f"GGUF file {info.path} does not fit the model it describes:\n  "
                            + "\n  ".join(problems))
    return plans


def _expert_format(name: str, types: dict[str, str], hidden: int) -> str | None:
    """The packed format a stacked expert tensor keeps (None: dequantized): its type's native
    format, for gate and up only when both map to the same one (they share one packed
    ``w13``), and only with whole blocks along the hidden size."""
    fmt = gguf_types.native_format(types[name])
    if fmt is None or hidden % BLOCK:
        return None
    head, _, leaf = name.rpartition(".ffn_")
    sibling = {"gate_exps.weight": "up_exps.weight", "up_exps.weight": "gate_exps.weight"}.get(leaf)
    if sibling is not None and gguf_types.native_format(types.get(f"{head}.ffn_{sibling}", "")) != fmt:
        return None
    return fmt


def _raw(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's bytes as a ``uint8`` tensor ``[rows, row_bytes]`` (a copy out of the map)."""
    data = tensor.data.reshape(-1).view("uint8")
    rows = 1
    for d in tensor.shape[:-1]:
        rows *= d
    out = torch.empty(data.shape[0], dtype=torch.uint8)
    hugepages.advise(out)  # before the copy writes it: kept packed, it is streamed every step
    out.numpy()[:] = data
    return out.reshape(rows, -1)


def _dequantize_rows(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """``[rows, row_bytes]`` bytes of a quantized type as ``[rows, k]`` float32 (ggml's values)."""
    rows = raw.shape[0]
    if type_name in gguf_types.PACKED_TYPES:
        return dequantize(raw, type_name.lower())
    if type_name == "Q4_K":
        return gguf_types.dequantize_q4_k(raw.reshape(-1, 144)).reshape(rows, -1)
    return gguf_types.dequantize_q6_k(raw.reshape(-1, 210)).reshape(rows, -1)


def _float_values(plan: TensorPlan, dtype: torch.dtype) -> torch.Tensor:
    """The tensor's values in its shape, cast to ``dtype`` (the model's: the cast a copy into
    the parameter would make); a quantized one is dequantized :data:`_CHUNK_WEIGHTS` weights
    at a time, so a large embedding never exists in float32 whole."""
    raw, shape = _raw(plan.tensor), plan.tensor.shape
    name = plan.type_name
    if name in gguf_types.DENSE_TYPES:
        return gguf_types.dense_values(raw, name, shape).to(dtype)
    out = torch.empty(raw.shape[0], shape[-1], dtype=dtype)
    step = max(1, _CHUNK_WEIGHTS // shape[-1])
    for start in range(0, raw.shape[0], step):
        out[start:start + step] = _dequantize_rows(raw[start:start + step], name)
    return out.reshape(shape)


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows from llama.cpp's interleaved rotary pairs back to each head's two halves."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1)
    back = flat.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(flat.shape)
    return back.reshape(t.shape)


def _local_packed(param: torch.Tensor, packed: torch.Tensor, fmt: str, shard: Hashable | None,
                  name: str) -> torch.Tensor:
    """This rank's part of a full packed weight (rows for column / vocabulary splits, whole
    blocks of columns for a row-parallel split) for the staging parameter ``param``."""
    spec = shard_spec_of(param)
    if spec is None:
        return packed
    if spec.dim == 0:
        segments = spec.by_shard[shard][1] if shard is not None else spec.segments
        rows = param.shape[0] if shard is None else sum(length for _, _, length in segments)
        out = torch.zeros(rows, packed.shape[1], dtype=torch.uint8)
        base = 0 if shard is None else min(local for _, local, _ in segments)
        for full_start, local_start, length in segments:
            out[local_start - base:local_start - base + length] = packed[full_start:full_start + length]
        return out
    block_bytes = get_format(fmt).block_bytes
    parts = []
    for full_start, _, length in spec.segments:
        if full_start % BLOCK or length % BLOCK:
            raise GGUFLoadError(f"{name}: this rank's columns [{full_start}, {full_start + length}) "
                                f"cut a {BLOCK}-weight block; use a tensor_parallel_size that "
                                f"leaves a multiple of {BLOCK} per rank")
        parts.append(packed[:, full_start // BLOCK * block_bytes:(full_start + length) // BLOCK * block_bytes])
    return torch.cat(parts, dim=1)


def _stacked_shape(tensor: GGUFTensor) -> tuple[int, int]:
    """``(experts, rows per expert)`` of a stacked expert tensor (torch order ``[E, rows, k]``)."""
    experts, rows, _ = tensor.shape
    return experts, rows


def _stream(plans: list[TensorPlan], path: str) -> Iterator[TensorPlan]:
    """``plans`` in order, logging progress every 10 % of the bytes of a large file."""
    total = sum(p.tensor.nbytes for p in plans)
    done, next_mark = 0, 10
    for plan in plans:
        yield plan
        done += plan.tensor.nbytes
        if total >= PROGRESS_MIN_BYTES and done * 100 >= next_mark * total:
            logger.info("Loading %s: %d%% (%.2f of %.2f GB)", path, done * 100 // total,
                        done / 1e9, total / 1e9)
            next_mark = done * 100 // total // 10 * 10 + 10


def load_gguf_weights(model: LlamaForCausalLM, path: str, dtype: torch.dtype) -> set[str]:
    """Fill ``model`` (built from the file's metadata, parameters in ``dtype``) from GGUF file
    ``path``; returns the names of the parameters filled. Raises :class:`GGUFLoadError`
    (nothing read yet) when the file does not fit the model."""
    info = open_gguf(path)
    plans = gguf_tensor_plan(info, model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    pending: dict[str, dict[Hashable | None, tuple[str, torch.Tensor]]] = {}
    loaded: set[str] = set()
    module_names = {id(m): n for n, m in model.named_modules()}

    def dense_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for plan in _stream(plans, path):
            if plan.packed_format is not None and plan.expert_kind is not None:
                _take_packed_experts(plan)
                continue
            if plan.packed_format is not None and plan.hf_name == "model.embed_tokens.weight":
                _take_packed_table(plan)
                continue
            if plan.packed_format is not None:
                _take_packed(plan)
                continue
            values = _float_values(plan, dtype)
            if plan.rotary_heads:
                values = _unpermute(values, plan.rotary_heads)
            if plan.expert_kind is not None:
                for expert in range(values.shape[0]):
                    yield f"{plan.hf_name}.{expert}.{plan.expert_kind}.weight", values[expert]
            else:
                yield plan.hf_name, values

    def _take_packed_table(plan: TensorPlan) -> None:
        """A quantized token embedding kept packed (this rank's rows of the vocabulary); a head
        tied to it shares the table."""
        assert plan.packed_format is not None
        raw = _raw(plan.tensor)
        packed = gguf_types.packed_values(raw, plan.type_name, raw.shape[0], plan.tensor.name)
        local = _local_packed(params[plan.hf_name], packed, plan.packed_format, None,
                              plan.tensor.name)
        head = model.lm_head if model.tie_word_embeddings else None
        install_packed_table(model.model.embed_tokens, plan.packed_format, local, head)
        loaded.add(plan.hf_name)
        if head is not None:
            loaded.add("lm_head.weight")

    def _take_packed_experts(plan: TensorPlan) -> None:
        """A stacked expert tensor kept packed: this rank's experts (and intermediate slice)
        installed into the MoE layer; gate and up wait for each other (one ``w13``)."""
        assert plan.packed_format is not None and plan.expert_kind is not None
        layer = model.get_submodule(plan.hf_name)
        assert isinstance(layer, FusedMoE)
        experts, rows = _stacked_shape(plan.tensor)
        raw = _raw(plan.tensor)
        packed = gguf_types.packed_values(raw, plan.type_name, raw.shape[0], plan.tensor.name)
        packed = packed.reshape(experts, rows, -1)
        try:
            local = layer.local_packed(packed, plan.expert_kind, plan.packed_format)
        except ValueError as exc:
            raise GGUFLoadError(f"{plan.tensor.name}: {exc}") from None
        prefix = module_names[id(layer)]  # the name its parameters are listed under
        if plan.expert_kind == "w2":
            layer.install_packed("w2_weight", local, plan.packed_format)
            loaded.add(f"{prefix}.w2_weight")
            return
        parts = pending.setdefault(f"{plan.hf_name}.w13_weight", {})
        parts[plan.expert_kind] = (plan.packed_format, local)
        if "w1" in parts and "w3" in parts:
            layer.install_packed("w13_weight", torch.cat([parts["w1"][1], parts["w3"][1]], dim=1),
                                 plan.packed_format)
            del pending[f"{plan.hf_name}.w13_weight"]
            loaded.add(f"{prefix}.w13_weight")

    def _take_packed(plan: TensorPlan) -> None:
        assert plan.packed_format is not None
        mapped = model.map_weight_name(plan.hf_name)
        if mapped is None:  # an untied head of a tied model cannot happen (the config is the file's)
            return
        param_name, shard = mapped
        raw = _raw(plan.tensor)
        packed = gguf_types.packed_values(raw, plan.type_name, raw.shape[0], plan.tensor.name)
        if plan.rotary_heads:
            packed = _unpermute(packed, plan.rotary_heads)
        local = _local_packed(params[param_name], packed, plan.packed_format, shard, plan.tensor.name)
        parts = pending.setdefault(param_name, {})
        parts[shard] = (plan.packed_format, local)
        owner = model.get_submodule(param_name.rpartition(".")[0])
        order: list[Hashable | None] = (list(owner.shard_offsets) if isinstance(owner, MergedLinear)
                                        else [None])
        if all(s in parts for s in order):
            assert isinstance(owner, (Linear, LMHead))
            install_packed_weight(owner, [parts[s] for s in order])
            del pending[param_name]
            loaded.add(param_name)

    loaded |= model.load_weights(dense_weights())
    if pending:  # the plan checked that every part is in the file
        raise GGUFLoadError(f"GGUF file {path}: incomplete packed projections {sorted(pending)}")
    packed_count = sum(1 for m in model.modules()
                       if isinstance(m, (Linear, LMHead)) and m.quant_method is not None)
    packed_experts = sum(1 for m in model.modules() if isinstance(m, FusedMoE)
                         for p in (m.w13_weight, m.w2_weight) if p.dtype == torch.uint8)
    table = model.model.embed_tokens.quant_method
    logger.info("Loaded %s from GGUF file %s: %d tensors, %d projections%s kept packed%s",
                type(model).__name__, path, len(plans), packed_count,
                f" and {packed_experts} stacked expert weights" if packed_experts else "",
                "" if table is None else f", the token embedding as {table.format.name}")
    return loaded


def packed_modules(model: nn.Module) -> list[tuple[str, str]]:
    """``(module name, format)`` of every layer of ``model`` holding a packed weight."""
    return [(name, m.quant_method.format.name) for name, m in model.named_modules()
            if isinstance(m, (Linear, LMHead)) and m.quant_method is not None]
