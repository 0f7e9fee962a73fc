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
3. :meth:`~QuantizedLinearMethod.apply` calls the ``forwardkit::quant_linear`` op.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import torch
import torch.nn as nn

from forwardkit.quantization import ops as _ops  # noqa: F401  (registers forwardkit::quant_linear)
from forwardkit.quantization.formats import BLOCK, QuantFormat, get_format, quantize

__all__ = ["QuantizedLayer", "QuantizedLinearMethod", "QuantizedWeightReloadError"]


class QuantizedWeightReloadError(ValueError):
    """A write into a weight that is already quantized (in-place reloading is not supported)."""


class QuantizedLayer(Protocol):
    """What the method needs of a layer: its sizes and its ``weight`` (staging or packed)."""

    input_size: int
    output_size: int
    weight: nn.Parameter


def _refuse_reload(param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
    raise QuantizedWeightReloadError(
        f"this weight is quantized (packed shape {tuple(param.shape)}); quantized weights cannot "
        "be written in place: load the model again instead")


class QuantizedLinearMethod:
    """Weights in block format :attr:`format` (``q8_0``, ``q4_0``, ``q4_1``)."""

    def __init__(self, fmt: str | QuantFormat) -> None:
        self.format = get_format(fmt) if isinstance(fmt, str) else fmt

    def create_weights(self, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> nn.Parameter:
        """The layer's staging weight ``[output_size, input_size]`` (quantized after loading)."""
        return nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def check_shape(self, layer: QuantizedLayer, name: str) -> None:
        """ValueError naming ``name`` when the layer's input dim is not a whole number of blocks."""
        if layer.input_size % BLOCK:
            raise ValueError(
                f"cannot quantize {name} to {self.format.name}: its input dim {layer.input_size} "
                f"(weight shape {(layer.output_size, layer.input_size)}) is not a multiple of the "
                f"{BLOCK}-weight block; run this model without quantization")

    @staticmethod
    def is_quantized(layer: QuantizedLayer) -> bool:
        """Whether ``layer``'s weight is packed already."""
        return layer.weight.dtype == torch.uint8

    def process_weights_after_loading(self, layer: QuantizedLayer, name: str = "weight") -> nn.Parameter:
        """Quantize the loaded staging weight into the packed one (no-op when packed already);
        returns the layer's (new) weight parameter."""
        if self.is_quantized(layer):
            return layer.weight
        self.check_shape(layer, name)
        packed = nn.Parameter(quantize(layer.weight.data, self.format, name), requires_grad=False)
        packed.weight_loader = _refuse_reload  # type: ignore[attr-defined]
        packed.quant_format = self.format.name  # type: ignore[attr-defined]
        layer.weight = packed
        return packed

    def apply(self, layer: QuantizedLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` through the ``forwardkit::quant_linear`` op."""
        if not self.is_quantized(layer):
            raise RuntimeError(f"a {self.format.name} layer ran before its weight was quantized "
                               "(the model loader quantizes each weight once it is loaded)")
        return torch.ops.forwardkit.quant_linear(x, layer.weight, bias, self.format.name)
