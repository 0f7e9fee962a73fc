"""The registered ops of quantized weights: ``forwardkit::quant_linear(x, packed, bias, fmt)``
(projections, the LM head), ``forwardkit::quant_linear_q8(q, d, s, packed, bias, fmt)``
(the same product on activations already rounded to int8, which the ``fuse_norm_quant`` /
``fuse_act_quant`` passes put in place of ``quant_linear``) and
``forwardkit::quant_embedding(ids, packed, fmt, dtype)`` (the token embedding's lookup).

``packed`` is a weight in one of :mod:`~forwardkit.quantization.formats`'s layouts (``uint8``
``[out, in / 32 * block_bytes]``); the op returns ``x @ W.T + bias`` in ``x``'s dtype, ``W``
being the weight ``packed`` holds. Compiled graphs keep the op as one node (its fake
implementation gives the output's shape), like ``forwardkit::linear``.

Paths, chosen per call by the number of activation rows:

* on the CPU, every format (``q8_0``, ``q4_0``, ``q4_1``), the native kernels of
  ``kernels/cpu/native_quant.py``, which read the packed blocks directly: below
  :data:`~forwardkit.kernels.cpu.native_quant.TILES_MIN_ROWS` rows (decode of one sequence)
  the few-row kernel, from there (batched decode, prompts) the tiled kernel (activations
  quantized per block to int8 once per call, integer dot products over tiles of 8 weight rows);
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
from forwardkit.quantization.formats import BLOCK, dequantize, get_format, quantize_activations

__all__ = ["quant_embedding", "quant_linear", "quant_linear_q8", "reference_linear"]


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


def quant_linear_q8(q: torch.Tensor, d: torch.Tensor, sums: torch.Tensor, packed: torch.Tensor,
                    bias: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """:func:`quant_linear` of the activations that
    :func:`~forwardkit.quantization.formats.quantize_activations` rounded to ``(q, d, sums)``,
    in float32 (the caller casts it, as the float call does): on the CPU the native kernels'
    products of the float call, bit for bit (they round activations the same way); elsewhere
    the rounded activations times the dequantized weight."""
    get_format(fmt)
    if q.device.type == "cpu":
        out = native_quant.quant_linear_q8_rows(q, d, sums, packed, bias, fmt, torch.float32)
        if out is not None:
            return out
    k = q.shape[-1]
    x = (q.to(torch.float32).reshape(*q.shape[:-1], k // BLOCK, BLOCK) * d.unsqueeze(-1))
    return reference_linear(x.reshape(q.shape), packed,
                            None if bias is None else bias.to(torch.float32), fmt)


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
_LIB.define("quant_linear_q8(Tensor q, Tensor d, Tensor s, Tensor packed, Tensor? bias, str fmt) "
            "-> Tensor")
_LIB.impl("quant_linear_q8", quant_linear_q8, "CompositeExplicitAutograd")
_LIB.define("quant_embedding(Tensor ids, Tensor packed, str fmt, ScalarType dtype) -> Tensor")
_LIB.impl("quant_embedding", quant_embedding, "CompositeExplicitAutograd")


@torch.library.register_fake("forwardkit::quant_linear", lib=_LIB)
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.register_fake("forwardkit::quant_linear_q8", lib=_LIB)
def _fake_q8(q: torch.Tensor, d: torch.Tensor, sums: torch.Tensor, packed: torch.Tensor,
             bias: torch.Tensor | None, fmt: str) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], packed.shape[0]), dtype=torch.float32)


@torch.library.register_fake("forwardkit::quant_embedding", lib=_LIB)
def _fake_embedding(ids: torch.Tensor, packed: torch.Tensor, fmt: str,
                    dtype: torch.dtype) -> torch.Tensor:
    dim = packed.shape[1] // get_format(fmt).block_bytes * BLOCK
    return packed.new_empty((*ids.shape, dim), dtype=dtype)


@torch.library.custom_op("forwardkit::quantize_activations", mutates_args=())
def quantize_activations_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~forwardkit.quantization.formats.quantize_activations` as an op: the quant
    fusions (``quantization/fusion.py``) put it in a graph and then trace it to plain torch ops
    in place, so Inductor computes it inside the kernel that produces ``x``."""
    return quantize_activations(x)


@quantize_activations_op.register_fake
def _fake_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = (*x.shape[:-1], x.shape[-1] // BLOCK)
    return (x.new_empty(x.shape, dtype=torch.int8), x.new_empty(blocks, dtype=torch.float32),
            x.new_empty(blocks, dtype=torch.float32))
