"""Block-quantized weight formats (the GGUF / ggml block layouts) and their torch
quantize / dequantize.

Every format cuts each row of a ``[rows, k]`` weight into blocks of :data:`BLOCK` = 32
consecutive weights and stores each block as the bytes ggml stores it, so a packed weight is a
``uint8`` tensor ``[rows, k / 32 * block_bytes]`` whose bytes are those a GGUF file holds:

* ``q8_0`` (34 bytes a block): fp16 scale ``d``, then 32 int8 ``q``; ``x = d * q``.
* ``q4_0`` (18 bytes): fp16 ``d``, then 16 bytes of 4-bit ``q``: byte ``j`` holds element ``j``
  in its low nibble and element ``j + 16`` in its high nibble; ``x = d * (q - 8)``.
* ``q4_1`` (20 bytes): fp16 ``d``, fp16 minimum ``m``, then 16 bytes of nibbles in ``q4_0``'s
  order; ``x = d * q + m``.

:func:`quantize` rounds each block as ggml's reference quantizers do (float32 arithmetic, the
scale's reciprocal multiplied in, fp16 scales rounded to nearest even), so a checkpoint gives the
same bytes here as in ``llama-quantize`` for these types; :func:`dequantize` gives float32 values
bit for bit equal to ggml's (and the ``gguf`` package's) dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forwardkit.config.model import QUANTIZATION_FORMATS
from forwardkit.kernels.cpu import hugepages

__all__ = ["BLOCK", "FORMATS", "BlockShapeError", "QuantFormat", "dequantize", "get_format",
           "packed_shape", "quantize", "quantize_activations"]

BLOCK = 32


class BlockShapeError(ValueError):
    """A weight whose rows are not a whole number of ``BLOCK``-weight blocks, refused (named)
    before anything is read."""


# weights converted at once (whole rows): bounds the float32 temporaries of a big matrix to a
# few MB, so quantizing a weight adds little to the memory its packed bytes take
_WEIGHTS_PER_CHUNK = 1 << 18


@dataclass(frozen=True)
class QuantFormat:
    """One block format: its name and the bytes one block of :data:`BLOCK` weights takes."""

    name: str
    block_bytes: int
    bits: int

    def packed_shape(self, rows: int, k: int) -> tuple[int, int]:
        """Shape of the packed ``uint8`` tensor of a ``[rows, k]`` weight (``k % 32 == 0``)."""
        return rows, k // BLOCK * self.block_bytes


FORMATS: dict[str, QuantFormat] = {
    "q8_0": QuantFormat("q8_0", 2 + BLOCK, 8),
    "q4_0": QuantFormat("q4_0", 2 + BLOCK // 2, 4),
    "q4_1": QuantFormat("q4_1", 4 + BLOCK // 2, 4),
}
assert tuple(FORMATS) == QUANTIZATION_FORMATS, "config.model.QUANTIZATION_FORMATS out of date"


def get_format(name: str) -> QuantFormat:
    """The format called ``name``; ValueError naming the accepted ones otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"quantization must be one of {list(FORMATS)}, got {name!r}")
    return fmt


def packed_shape(fmt: QuantFormat | str, rows: int, k: int) -> tuple[int, int]:
    """Shape of the packed ``uint8`` tensor of a ``[rows, k]`` weight in ``fmt``."""
    return (get_format(fmt) if isinstance(fmt, str) else fmt).packed_shape(rows, k)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` (halves away from zero), exactly, on float32 values."""
    a = v.abs()
    floored = torch.floor(a)
    return torch.sign(v) * (floored + torch.floor(2 * (a - floored)))


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """``1 / d`` in float32, 0 where ``d`` is 0 (ggml's ``id``)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """``[n, 1]`` float32 values as ``[n, 2]`` bytes of their fp16 (round to nearest even)."""
    return v.to(torch.float16).view(torch.uint8).reshape(v.shape[0], 2)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[n, 32]`` values 0..15 as ``[n, 16]`` bytes: element j low, element j + 16 high."""
    q = q.to(torch.uint8)
    return q[:, : BLOCK // 2] | (q[:, BLOCK // 2:] << 4)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes as ``[n, 32]`` uint8 values (inverse of :func:`_pack_nibbles`)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _quantize_blocks(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """``[n, 32]`` float32 blocks as ``[n, block_bytes]`` bytes (ggml's reference rounding)."""
    if name == "q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        q = _roundf(blocks * _reciprocal(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_fp16_bytes(d), q], dim=1)
    if name == "q4_0":
        # the element of largest magnitude, with its sign (the first one on ties)
        index = blocks.abs().argmax(dim=1, keepdim=True)
        d = torch.gather(blocks, 1, index) / -8
        q = torch.trunc(blocks * _reciprocal(d) + 8.5).clamp(0, 15)
        return torch.cat([_fp16_bytes(d), _pack_nibbles(q)], dim=1)
    if name == "q4_1":
        lo = blocks.amin(dim=1, keepdim=True)
        hi = blocks.amax(dim=1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.trunc((blocks - lo) * _reciprocal(d) + 0.5).clamp(0, 15)
        return torch.cat([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], dim=1)
    raise ValueError(f"quantization must be one of {list(FORMATS)}, got {name!r}")


def _bf16_rounded(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` rounded to the nearest bf16 (ties to even), in integers on its bits: a
    no-op on values that are bf16 already. Inductor keeps a bf16 intermediate in float32
    inside a fused kernel; this makes the rounding the unfused graph does when it stores the
    activations explicit, so both quantize the same values (finite values: activations)."""
    bits = v.view(torch.int32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -0x10000
    return bits.view(torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations ``x`` (``[..., k]``, any float dtype, ``k % 32 == 0``) rounded per block of
    32 to int8 as the native quantized kernels round them (ggml's q8_0 rule in float32, the
    scale kept in float32): ``(q, d, s)`` with ``q`` int8 ``[..., k]``, ``d = max|x| / 127``
    and ``s = d * sum(q)`` float32 ``[..., k / 32]``. Plain torch ops, so a compiled graph
    computes them inside the kernel that produces ``x``; the values equal the kernels' own
    rounding bit for bit (``forwardkit::quant_linear_q8`` takes them). bf16 activations are
    taken at bf16 precision even where a compiled graph holds them wider."""
    k = x.shape[-1]
    v = x.to(torch.float32)
    if x.dtype == torch.bfloat16:
        v = _bf16_rounded(v)
    blocks = v.reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = _roundf(blocks * _reciprocal(d))
    s = d * q.sum(dim=-1, keepdim=True)
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1), s.squeeze(-1)


def _dequantize_blocks(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """``[n, block_bytes]`` bytes as ``[n, 32]`` float32 values."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if name == "q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8).float() * d
    if name == "q4_0":
        return (_unpack_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float() * d
    if name == "q4_1":
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        return _unpack_nibbles(blocks[:, 4:]).float() * d + m  # two roundings, as ggml (no FMA)
    raise ValueError(f"quantization must be one of {list(FORMATS)}, got {name!r}")


def quantize(weight: torch.Tensor, fmt: QuantFormat | str, name: str = "weight") -> torch.Tensor:
    """``weight`` ``[rows, k]`` (any float dtype, ``k % 32 == 0``) packed in ``fmt``: a
    ``uint8`` ``[rows, k / 32 * block_bytes]`` tensor on the same device. ``name`` names the
    tensor in the error for a ``k`` that is not a multiple of 32."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: only 2-D floating-point weights can be quantized, got "
                         f"{weight.dim()}-D {weight.dtype}")
    rows, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{name}: input dim {k} (shape {tuple(weight.shape)}) is not a multiple "
                         f"of {BLOCK}, the {fmt.name} block size")
    out = torch.empty(fmt.packed_shape(rows, k), dtype=torch.uint8, device=weight.device)
    hugepages.advise(out)  # before the first write: the blocks fault in on huge pages (CPU)
    with torch.no_grad():
        step = max(1, _WEIGHTS_PER_CHUNK // k)
        for start in range(0, rows, step):
            part = weight[start:start + step].float().reshape(-1, BLOCK)
            n = min(step, rows - start)
            out[start:start + n] = _quantize_blocks(part, fmt.name).reshape(n, -1)
    return out


def dequantize(packed: torch.Tensor, fmt: QuantFormat | str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[rows, k]`` weight ``packed`` (from :func:`quantize`) holds, in ``dtype`` (the
    float32 values ggml's dequantization gives, cast)."""
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % fmt.block_bytes:
        raise ValueError(f"not a packed {fmt.name} weight: {packed.dim()}-D {packed.dtype} of "
                         f"shape {tuple(packed.shape)} (need uint8 [rows, n * {fmt.block_bytes}])")
    rows = packed.shape[0]
    k = packed.shape[1] // fmt.block_bytes * BLOCK
    values = _dequantize_blocks(packed.reshape(-1, fmt.block_bytes), fmt.name)
    return values.reshape(rows, k).to(dtype)
