"""The quantized linear method: the object a linear layer holds to create, quantize and apply
its weight in a block format, instead of branching on the format inside every layer (vLLM's
``QuantizeMethodBase``: ``create_weights`` / ``process_weights_after_loading`` / ``apply``).

Life of a quantized layer's weight:

1. :meth:`QuantizedLinearMethod.create_weights` gives the layer a full-precision *staging*
   weight ``[out, in]`` in the model's dtype, not yet written (untouched memory is not resident),
   so every existing weight loader, shard layout and the seeded random fill work unchanged;
2. once the loader has filled it (all shards of a merged projection), the loader calls
   :meth:`~QuantizedLinearMethod.process_weights_after_loading`, which quantizes it
   (:func:`~forwardkit.quantization.formats.quantize`) and replaces it with the packed
   ``uint8`` weight; the staging tensor is freed, so a checkpoint loads one projection at a time
   at full precision;
3. :meth:`~QuantizedLinearMethod.apply` calls the ``forwardkit::quant_linear`` op (the native
   kernels) when the layer runs its CPU form (the ``cpu_linear`` custom op on, the default), else
   computes dequantize-then-``F.linear`` in plain torch (``"-cpu_linear"``: the layer's native
   form; the one switch of the native linear kernels, ``config/custom_ops.py``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

from forwardkit.compilation.pass_registry import register_flag_pass
from forwardkit.quantization import ops as _ops  # registers forwardkit::quant_linear
from forwardkit.quantization.formats import (
    BLOCK,
    BlockShapeError,
    QuantFormat,
    get_format,
    quantize,
)

if TYPE_CHECKING:
    from forwardkit.config.pass_config import PassConfig

__all__ = ["EmbeddingTable", "PackedWeightLayer", "QuantizedEmbeddingMethod", "QuantizedLayer",
           "QuantizedLinearMethod", "QuantizedWeightReloadError", "SplitQuantizedLinearMethod",
           "install_packed_weight"]


def _project(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fmt: str,
             kernel: bool) -> torch.Tensor:
    """The op (``kernel``) or its plain-torch reference (:func:`ops.reference_linear`)."""
    if kernel:
        return torch.ops.forwardkit.quant_linear(x, packed, bias, fmt)
    return _ops.reference_linear(x, packed, bias, fmt)


class QuantizedWeightReloadError(ValueError):
    """A write into a weight that is already quantized (in-place reloading is not supported)."""


class PackedWeightLayer(Protocol):
    """What :meth:`QuantizedLinearMethod.apply` needs of a layer: its (packed) ``weight``."""

    weight: nn.Parameter


class QuantizedLayer(PackedWeightLayer, Protocol):
    """What the method needs of a layer it quantizes: its sizes and its ``weight`` (staging or
    packed)."""

    input_size: int
    output_size: int


def _refuse_reload(param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    raise QuantizedWeightReloadError(
        f"this weight is quantized (packed shape {tuple(param.shape)}); quantized weights cannot "
        "be written in place: load the model again instead")


def _packed_param(data: torch.Tensor, fmt: str) -> nn.Parameter:
    """Packed bytes ``data`` in format ``fmt`` as a parameter that names its format and refuses
    in-place reloads (every packed weight and table is made here)."""
    packed = nn.Parameter(data.contiguous(), requires_grad=False)
    packed.weight_loader = _refuse_reload  # type: ignore[attr-defined]
    packed.quant_format = fmt  # type: ignore[attr-defined]
    return packed


def _packed_parameter(staging: torch.Tensor, fmt: QuantFormat, name: str) -> nn.Parameter:
    """``staging`` (a loaded full-precision weight) quantized into a packed parameter."""
    return _packed_param(quantize(staging.data, fmt, name), fmt.name)


class QuantizedLinearMethod:
    """Weights in block format :attr:`format` (``q8_0``, ``q4_0``, ``q4_1``)."""

    def __init__(self, fmt: str | QuantFormat) -> None:
        self.format = get_format(fmt) if isinstance(fmt, str) else fmt

    def create_weights(self, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> nn.Parameter:
        """The layer's staging weight ``[output_size, input_size]`` (quantized after loading)."""
        return nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def check_shape(self, layer: QuantizedLayer, name: str) -> None:
        """BlockShapeError (a ValueError) naming ``name`` when the layer's input dim is not a
        whole number of blocks."""
        if layer.input_size % BLOCK:
            raise BlockShapeError(
                f"cannot quantize {name} to {self.format.name}: its input dim {layer.input_size} "
                f"(weight shape {(layer.output_size, layer.input_size)}) is not a multiple of the "
                f"{BLOCK}-weight block; run this model without quantization")

    @staticmethod
    def is_quantized(layer: PackedWeightLayer) -> bool:
        """Whether ``layer``'s weight is packed already."""
        return layer.weight.dtype == torch.uint8

    def process_weights_after_loading(self, layer: QuantizedLayer, name: str = "weight") -> nn.Parameter:
        """Quantize the loaded staging weight into the packed one (no-op when packed already);
        returns the layer's (new) weight parameter."""
        if self.is_quantized(layer):
            return layer.weight
        self.check_shape(layer, name)
        layer.weight = _packed_parameter(layer.weight, self.format, name)
        return layer.weight

    def apply(self, layer: PackedWeightLayer, x: torch.Tensor, bias: torch.Tensor | None,
              kernel: bool = True) -> torch.Tensor:
        """``x @ W.T + bias``: through the ``forwardkit::quant_linear`` op (native kernels where
        they apply) with ``kernel``, else dequantize-then-``F.linear`` in plain torch (the
        layer's native form, ``"-cpu_linear"``)."""
        if not self.is_quantized(layer):
            raise RuntimeError(f"a {self.format.name} layer ran before its weight was quantized "
                               "(the model loader quantizes each weight once it is loaded)")
        return _project(x, layer.weight, bias, self.format.name, kernel)


class EmbeddingTable(PackedWeightLayer, Protocol):
    """What :class:`QuantizedEmbeddingMethod` needs of an embedding: its sizes, its dtype (the
    lookup's output) and its ``weight`` (staging or packed)."""

    num_embeddings: int
    embedding_dim: int
    dtype: torch.dtype


class QuantizedEmbeddingMethod:
    """A token embedding table held in block format :attr:`format`: created, filled and
    quantized like a projection's weight (a staging table, packed once loaded), looked up by
    the ``forwardkit::quant_embedding`` op, which dequantizes only the rows it gathers. A head
    tied to the table shares the packed weight (through its own
    :class:`QuantizedLinearMethod`)."""

    def __init__(self, fmt: str | QuantFormat) -> None:
        self.format = get_format(fmt) if isinstance(fmt, str) else fmt

    def create_weights(self, num_embeddings: int, embedding_dim: int,
                       dtype: torch.dtype | None) -> nn.Parameter:
        """The staging table ``[num_embeddings, embedding_dim]`` (quantized after loading)."""
        return nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)

    def check_shape(self, layer: EmbeddingTable, name: str) -> None:
        """BlockShapeError (a ValueError) naming ``name`` when a row is not a whole number of blocks."""
        if layer.embedding_dim % BLOCK:
            raise BlockShapeError(
                f"cannot quantize {name} to {self.format.name}: its embedding dim "
                f"{layer.embedding_dim} is not a multiple of the {BLOCK}-weight block; run this "
                "model without quantization")

    def process_weights_after_loading(self, layer: EmbeddingTable, name: str = "weight") -> nn.Parameter:
        """Quantize the loaded staging table (no-op when packed already); returns the layer's
        (new) weight parameter."""
        if QuantizedLinearMethod.is_quantized(layer):
            return layer.weight
        self.check_shape(layer, name)
        layer.weight = _packed_parameter(layer.weight, self.format, name)
        return layer.weight

    def apply(self, layer: EmbeddingTable, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` in ``layer.dtype`` through ``forwardkit::quant_embedding``."""
        if not QuantizedLinearMethod.is_quantized(layer):
            raise RuntimeError(f"a {self.format.name} embedding ran before its table was quantized "
                               "(the model loader quantizes it once it is loaded)")
        return torch.ops.forwardkit.quant_embedding(ids, layer.weight, self.format.name, layer.dtype)


class SplitQuantizedLinearMethod(QuantizedLinearMethod):
    """A merged projection whose parts are packed in different formats (a GGUF file may store a
    layer's ``attn_v`` in another type than its ``attn_q`` / ``attn_k``): the layer's weight is
    the parts' bytes one after the other (a flat ``uint8`` tensor), and :meth:`apply` runs one
    ``forwardkit::quant_linear`` per part and concatenates the outputs.

    ``parts``: ``(rows, format)`` of each part, in output order. :attr:`format` is the first
    part's (what ``repr`` shows first)."""

    def __init__(self, parts: list[tuple[int, str]]) -> None:
        if len(parts) < 2:
            raise ValueError(f"a split quantized weight needs two parts or more, got {parts}")
        super().__init__(parts[0][1])
        self.parts = [(rows, get_format(fmt)) for rows, fmt in parts]

    def packed_parts(self, weight: torch.Tensor, input_size: int) -> list[torch.Tensor]:
        """Each part's ``[rows, input_size / 32 * block_bytes]`` view of the flat ``weight``."""
        views = []
        offset = 0
        for rows, fmt in self.parts:
            row_bytes = input_size // BLOCK * fmt.block_bytes
            views.append(weight.narrow(0, offset, rows * row_bytes).view(rows, row_bytes))
            offset += rows * row_bytes
        return views

    def apply(self, layer: PackedWeightLayer, x: torch.Tensor, bias: torch.Tensor | None,
              kernel: bool = True) -> torch.Tensor:
        """``x @ W.T + bias``, one ``forwardkit::quant_linear`` per part (or its plain-torch
        reference without ``kernel``)."""
        outs = []
        first = 0
        for (rows, fmt), packed in zip(self.parts, self.packed_parts(layer.weight, x.shape[-1])):
            part_bias = None if bias is None else bias.narrow(0, first, rows)
            outs.append(_project(x, packed, part_bias, fmt.name, kernel))
            first += rows
        return torch.cat(outs, dim=-1)


def install_packed_weight(layer: nn.Module, parts: list[tuple[str, torch.Tensor]]) -> nn.Parameter:
    """Give ``layer`` (a linear layer or the LM head) an already packed weight and the method
    that applies it: ``parts`` are ``(format, packed [rows, bytes])`` in output order, one for a
    plain projection, one per shard of a merged one. Parts in one format become one packed
    weight (:class:`QuantizedLinearMethod`); mixed formats a :class:`SplitQuantizedLinearMethod`.
    The weight refuses in-place reloads, like a quantized-on-load one."""
    formats = {fmt for fmt, _ in parts}
    method: QuantizedLinearMethod
    if len(formats) == 1:
        fmt = parts[0][0]
        method = QuantizedLinearMethod(fmt)
        data = torch.cat([p for _, p in parts], dim=0) if len(parts) > 1 else parts[0][1]
    else:
        method = SplitQuantizedLinearMethod([(p.shape[0], fmt) for fmt, p in parts])
        data = torch.cat([p.reshape(-1) for _, p in parts])
    packed = _packed_param(data, method.format.name)
    layer.weight = packed
    setattr(layer, "quant_method", method)  # noqa: B010 (a plain attribute, not a submodule)
    return packed


def install_packed_table(embedding: nn.Module, fmt: str, packed: torch.Tensor,
                         head: nn.Module | None = None) -> nn.Parameter:
    """Give ``embedding`` (a token embedding) an already packed ``[rows, bytes]`` table in
    ``fmt`` and the :class:`QuantizedEmbeddingMethod` that looks it up; ``head``, an LM head
    tied to it, shares the packed table through a :class:`QuantizedLinearMethod`. The table
    refuses in-place reloads, like a quantized-on-load one."""
    method = QuantizedEmbeddingMethod(fmt)
    table = _packed_param(packed, method.format.name)
    embedding.weight = table
    setattr(embedding, "quant_method", method)  # noqa: B010 (a plain attribute, not a submodule)
    if head is not None:
        head.weight = table
        setattr(head, "quant_method", QuantizedLinearMethod(fmt))  # noqa: B010
    return table


def _quant_fusion_pass(pass_config: PassConfig) -> object:
    """The ``fuse_norm_quant`` / ``fuse_act_quant`` pass (``quantization/fusion.py``, imported
    only here: it needs the compiler) when a flag asks for it, else None."""
    norm, act = bool(pass_config.fuse_norm_quant), bool(pass_config.fuse_act_quant)
    if not (norm or act):
        return None
    from forwardkit.quantization.fusion import QuantFusionPass

    return QuantFusionPass(norm, act)


register_flag_pass("quant_fusion", _quant_fusion_pass)
