"""Linear layers, vocabulary embedding and LM head (single device, no tensor parallelism).

:class:`Linear` and :class:`LMHead` are the ``cpu_linear`` custom op: built on the CPU with it
on (``compilation_config.custom_ops``: on unless ``"-cpu_linear"``, see
``config/custom_ops.py``), their forward calls the opaque ``forwardkit::linear`` op, whose
kernel (``kernels/cpu/router.py``) picks the fastest CPU path at run time; else plain
``F.linear``. The decision is made once, at construction, and is part of the compile hash.

Each parameter carries a ``weight_loader(param, tensor, shard_id=None)`` so model
``load_weights`` can copy Hugging Face tensors in, including into merged projections
(``q``/``k``/``v`` -> ``qkv_proj``; gate/up -> ``gate_up_proj``). A shape mismatch raises
:class:`WeightShapeError` naming the expected and given shapes.

A :class:`Linear` or :class:`LMHead` built with a ``quant_method``
(:class:`~forwardkit.quantization.linear_method.QuantizedLinearMethod`) lets the method create
its weight (a staging weight, quantized by the loader once loaded) and apply it (with the
``cpu_linear`` op on, the ``forwardkit::quant_linear`` op and its native kernels; with
``"-cpu_linear"``, dequantize-then-``F.linear`` in plain torch); it never calls
``forwardkit::linear``. A :class:`VocabEmbedding` built with one
(:class:`~forwardkit.quantization.linear_method.QuantizedEmbeddingMethod`) looks its rows up
through ``forwardkit::quant_embedding``; a head tied to it shares the packed table.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from forwardkit.compilation.custom_op import CustomOp
from forwardkit.kernels.cpu import router
from forwardkit.quantization.linear_method import QuantizedEmbeddingMethod, QuantizedLinearMethod

__all__ = ["CpuLinearLayer", "Linear", "LMHead", "LoRAHook", "MergedLinear", "VocabEmbedding", "WeightShapeError",
           "copy_weight", "linear_op_weights", "quantized_layers", "quantized_linears"]


class LoRAHook(Protocol):
    """What a projection's ``lora`` attribute is (a typing protocol, no base class): a module
    adding the adapters' products to the projection's output in place (``layers/lora.py``'s
    ``LoRASlots``)."""

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Add the products of ``x`` to ``out`` in place."""


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape of the parameter (slice) it is loaded into."""


def copy_weight(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``target`` (casting dtype); shapes must match exactly. ``loaded``
    may also be a lazily read source (``layers.parallel.TensorSource``), read here."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise WeightShapeError(f"expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
    if not isinstance(loaded, torch.Tensor):
        loaded = loaded.materialize()
    with torch.no_grad():
        target.copy_(loaded)
    router.refresh_packed(target)  # the bound router re-derives a packed copy of the weight


def _default_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} takes no shard id, got {shard_id!r}")
    copy_weight(param.data, loaded)


@CustomOp.register("cpu_linear")
class CpuLinearLayer(CustomOp):
    """Base of the layers that are the ``cpu_linear`` custom op: on the CPU with the op on,
    ``forward_cpu`` calls ``torch.ops.forwardkit.linear``; else ``forward_native`` calls
    ``F.linear``."""

    quant_method: QuantizedLinearMethod | None = None

    @property
    def calls_linear_op(self) -> bool:
        """Whether this layer's forward calls ``forwardkit::linear`` (chosen at construction;
        never for a quantized layer)."""
        return self.quant_method is None and self.forward_form == "cpu"


class Linear(CpuLinearLayer):
    """``y = x @ W.T + b`` with ``W`` [out, in] (HF layout)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None,
                 quant_method: QuantizedLinearMethod | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.quant_method = quant_method
        # LoRA slots (``layers/lora.py``'s ``LoRASlots``), attached by the engine when it
        # serves adapters: applied to the projection's output in place
        self.lora: LoRAHook | None = None
        if quant_method is not None:
            self.weight = quant_method.create_weights(input_size, output_size, dtype)
        else:
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                       requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        """Copy a whole HF tensor into ``param``."""
        _default_loader(param, loaded, shard_id)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None, op: bool) -> torch.Tensor:
        """``x @ W.T + bias``: by the quant method when there is one, else by the
        ``forwardkit::linear`` op (``op``) or ``F.linear``."""
        if self.quant_method is not None:
            out = self.quant_method.apply(self, x, bias, kernel=op)
        elif op:
            out = torch.ops.forwardkit.linear(x, self.weight, bias)
        else:
            out = F.linear(x, self.weight, bias)
        if self.lora is not None:
            self.lora.add_to(out, x)
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The projection by ``F.linear`` (or the quant method)."""
        return self.project(x, self.bias, op=False)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """The projection by the ``forwardkit::linear`` op (or the quant method)."""
        return self.project(x, self.bias, op=True)

    def extra_repr(self) -> str:
        quant = "" if self.quant_method is None else f", quantization={self.quant_method.format.name}"
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}{quant}"


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (one matmul).

    ``shards`` maps a shard id (e.g. ``"q"``, ``"k"``, ``"v"`` or ``0``, ``1``) to its output
    size, in output order; ``weight_loader(param, tensor, shard_id)`` fills one shard.
    """

    def __init__(self, input_size: int, shards: Sequence[tuple[Hashable, int]], bias: bool = False,
                 dtype: torch.dtype | None = None,
                 quant_method: QuantizedLinearMethod | None = None) -> None:
        self.shard_offsets: dict[Hashable, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards:
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        super().__init__(input_size, offset, bias=bias, dtype=dtype, quant_method=quant_method)
        self.output_sizes = [size for _, size in shards]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        """Copy one shard (``shard_id``) into its rows of ``param``."""
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        copy_weight(param.data.narrow(0, offset, size), loaded)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden]; with a ``quant_method`` the table is held packed
    and each lookup dequantizes only the rows it gathers."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None,
                 quant_method: QuantizedEmbeddingMethod | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.quant_method = quant_method
        if quant_method is not None:
            self.weight = quant_method.create_weights(num_embeddings, embedding_dim, self.dtype)
        else:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype),
                                       requires_grad=False)
        self.weight.weight_loader = _default_loader  # type: ignore[attr-defined]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this table (local row indices)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up the embeddings of ``input_ids``."""
        return self.lookup(input_ids)

    def extra_repr(self) -> str:
        quant = "" if self.quant_method is None else f", quantization={self.quant_method.format.name}"
        return f"{self.num_embeddings}, {self.embedding_dim}{quant}"


class LMHead(CpuLinearLayer):
    """Output projection to the vocabulary; ``tie_to`` shares the embedding table's weight
    (packed as the table is when both have a quant method: the loader quantizes the shared
    weight once and points both at it). A GGUF file's packed head gets a ``quant_method`` at
    load (``quantization.linear_method.install_packed_weight``)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tie_to: VocabEmbedding | None = None,
                 quant_method: QuantizedLinearMethod | None = None) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.input_size, self.output_size = hidden_size, vocab_size  # the quant method's view
        self.tied = tie_to is not None
        self.quant_method = quant_method
        if tie_to is not None:
            if (quant_method is None) != (tie_to.quant_method is None):
                raise ValueError("a head tied to an embedding is quantized exactly when the "
                                 "embedding is (they share one weight)")
            self.weight = tie_to.weight
        else:
            self.weight = (quant_method.create_weights(hidden_size, vocab_size, dtype)
                           if quant_method is not None else
                           nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False))
            self.weight.weight_loader = _default_loader  # type: ignore[attr-defined]

    def forward_native(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in float32, by ``F.linear`` (or the quant method of a packed head, in plain
        torch)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, None, kernel=False).float()
        return F.linear(hidden_states, self.weight).float()

    def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in float32, by the ``forwardkit::linear`` op (or the quant method of a packed
        head)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, None).float()
        return torch.ops.forwardkit.linear(hidden_states, self.weight, None).float()


def linear_op_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight, bias)`` of every layer of ``model`` whose forward calls ``forwardkit::linear``
    (what the loader hands to ``CpuLinearRouter.route_weights``)."""
    return [(cast(torch.Tensor, m.weight), getattr(m, "bias", None)) for m in model.modules()
            if isinstance(m, CpuLinearLayer) and m.calls_linear_op]


def quantized_linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """``(name, layer)`` of every projection of ``model`` that holds a quant method."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and m.quant_method is not None]


def quantized_layers(model: nn.Module) -> list[tuple[str, Linear | LMHead | VocabEmbedding]]:
    """``(name, layer)`` of every layer of ``model`` that holds a quant method: projections,
    the LM head and the token embedding (a tied head and its table are two entries sharing one
    weight)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (Linear, LMHead, VocabEmbedding)) and m.quant_method is not None]
