"""The registered ops of quantized weights: ``forwardkit::quant_linear(x, packed, bias, fmt)``
(projections, the LM head) and ``forwardkit::quant_embedding(ids, packed, fmt, dtype)`` (the
token embedding's lookup).

``packed`` is a weight in one of :mod:`~forwardkit.quantization.formats`'s layouts (``uint8``
``[out, in / 32 * block_bytes]``); the op returns ``x @ W.T + bias`` in ``x``'s dtype, ``W``
being the weight ``packed`` holds. Compiled graphs keep the op as one node (its fake
implementation gives the output's shape), like ``forwardkit::linear``.

Paths, chosen per call by the number of activation rows:

* on the CPU, every format (``q8_0``, ``q4_0``, ``q4_1``), the native kernels of
  ``kernels/cpu/native_quant.py``, which read the packed blocks directly: below
  :data:`~forwardkit.kernels.cpu.native_quant.TILES_MIN_ROWS` rows (decode of one or two
  sequences) the few-row kernel, from there (batched decode, prompts) the tiled kernel
  (activations quantized per block to int8 once per call, integer dot products over tiles of
  rows);
* otherwise (no native build, another device) the weight dequantized to ``x``'s dtype, then
  ``F.linear`` (a dequantized copy per call: correct, not fast), natively where a build exists
  (the same values as the torch dequantization of :func:`reference_linear`).

``quant_embedding`` gathers the packed rows of ``ids`` and dequantizes only those (natively
where a build exists, else by :func:`~forwardkit.quantization.formats.dequantize`: the same
float32 values, bit for bit), then casts them to ``dtype``: the rows of the dequantized table,
indexed, without ever dequantizing the table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forwardkit.kernels.cpu import native_quant
from forwardkit.quantization.formats import BLOCK, dequantize, get_format

__all__ = ["quant_embedding", "quant_linear", "reference_linear"]


def reference_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     fmt: str) -> torch.Tensor:
    """``F.linear`` with the weight dequantized to ``x``'s dtype (the reference path)."""
    return F.linear(x, dequantize(packed, fmt, x.dtype), bias)


def quant_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 fmt: str) -> torch.Tensor:
    """``x @ W.T + bias`` for the weight ``W`` that ``packed`` holds in format ``fmt``."""
    get_format(fmt)
    if x.device.type == "cpu":
        out = native_quant.quant_linear_rows(x, packed, bias, fmt)
        if out is not None:
            return out
        weight = native_quant.dequantize_rows(packed, fmt)  # the same values, natively
        if weight is not None:
            return F.linear(x, weight.to(x.dtype), bias)
    return reference_linear(x, packed, bias, fmt)


def quant_embedding(ids: torch.Tensor, packed: torch.Tensor, fmt: str,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the ``[vocab, dim]`` table ``packed`` holds in format ``fmt``, in
    ``dtype``: shape ``[*ids.shape, dim]``."""
    get_format(fmt)
    rows = packed.index_select(0, ids.reshape(-1))
    values = native_quant.dequantize_rows(rows, fmt) if rows.device.type == "cpu" else None
    if values is None:
        values = dequantize(rows, fmt)
    return values.to(dtype).reshape(*ids.shape, values.shape[-1])


# Registered with torch.library.Library (like forwardkit::linear): a lighter call than
# torch.library.custom_op's Python wrappers; it runs once per projection per step.
_LIB = torch.library.Library("forwardkit", "FRAGMENT")
_LIB.define("quant_linear(Tensor x, Tensor packed, Tensor? bias, str fmt) -> Tensor")
_LIB.impl("quant_linear", quant_linear, "CompositeExplicitAutograd")
_LIB.define("quant_embedding(Tensor ids, Tensor packed, str fmt, ScalarType dtype) -> Tensor")
_LIB.impl("quant_embedding", quant_embedding, "CompositeExplicitAutograd")


@torch.library.register_fake("forwardkit::quant_linear", lib=_LIB)
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.register_fake("forwardkit::quant_embedding", lib=_LIB)
def _fake_embedding(ids: torch.Tensor, packed: torch.Tensor, fmt: str,
                    dtype: torch.dtype) -> torch.Tensor:
    dim = packed.shape[1] // get_format(fmt).block_bytes * BLOCK
    return packed.new_empty((*ids.shape, dim), dtype=dtype)
