"""GGUF tensor types as forwardkit weights: which types load as dense tensors, which stay packed
in a block format of :mod:`~forwardkit.quantization.formats` and which are repacked into one.

A GGUF tensor of ``rows x k`` weights is ``rows`` rows of ``k / block * type_bytes`` bytes each
(ggml's blocks never cross a row). Per type:

* ``F32``, ``F16``, ``BF16``: dense; :func:`dense_values` gives a float tensor (cast to the
  model's dtype by the loader).
* ``Q8_0``, ``Q4_0``, ``Q4_1``: the very bytes of forwardkit's ``q8_0`` / ``q4_0`` / ``q4_1``
  (same block layout), kept packed unchanged.
* ``Q4_K`` (super-blocks of 256: fp16 ``d`` and ``dmin``, eight 6-bit scales and mins, 4-bit
  ``q``; ``x = d*sc * q - dmin*mn``): each 32-weight sub-block becomes one ``q4_1`` block with
  scale ``fp16(d*sc)`` and minimum ``fp16(-dmin*mn)``, its nibbles reordered into ``q4_1``'s
  order. Exact but for those two fp16 roundings (:func:`repack_q4_k`).
* ``Q6_K`` (super-blocks of 256: 6-bit ``q``, sixteen int8 scales, fp16 ``d``;
  ``x = d*sc * (q - 32)``): the values are requantized into ``q8_0`` blocks of 32 with ggml's
  reference rounding (one scale per 32 weights instead of two per-16 scales over a 6-bit grid):
  the error is at most half a ``q8_0`` step, ``max|x| / 254`` of the block (:func:`repack_q6_k`).

:func:`dequantize_q4_k` and :func:`dequantize_q6_k` give ggml's float32 values bit for bit (the
tests compare them with the ``gguf`` package's); every other type is refused by name
(:func:`describe_type`).
"""

from __future__ import annotations

import torch

from forwardkit.quantization.formats import BLOCK, FORMATS, quantize

__all__ = [
    "DENSE_TYPES", "PACKED_TYPES", "REPACKED_TYPES", "SUPPORTED_TYPES", "TYPE_IDS", "TYPE_NAMES",
    "block_geometry", "dense_values", "dequantize_q4_k", "dequantize_q6_k", "describe_type",
    "native_format", "packed_values", "repack_q4_k", "repack_q6_k",
]

# ggml's type ids (ggml.h ``enum ggml_type``) of the types named here.
TYPE_IDS: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15, "IQ2_XXS": 16,
    "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22,
    "IQ4_XS": 23, "I8": 24, "I16": 25, "I32": 26, "I64": 27, "F64": 28, "IQ1_M": 29, "BF16": 30,
    "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39,
}
TYPE_NAMES: dict[int, str] = {v: k for k, v in TYPE_IDS.items()}

DENSE_TYPES = ("F32", "F16", "BF16")
PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # the same bytes as forwardkit's formats
REPACKED_TYPES = {"Q4_K": "q4_1", "Q6_K": "q8_0"}  # GGUF type -> the format it becomes
SUPPORTED_TYPES = DENSE_TYPES + PACKED_TYPES + tuple(REPACKED_TYPES)

QK_K = 256  # weights in a k-quant super-block
_GEOMETRY: dict[str, tuple[int, int]] = {  # type -> (weights a block, bytes a block)
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (BLOCK, FORMATS["q8_0"].block_bytes), "Q4_0": (BLOCK, FORMATS["q4_0"].block_bytes),
    "Q4_1": (BLOCK, FORMATS["q4_1"].block_bytes),
    "Q4_K": (QK_K, 2 + 2 + 12 + QK_K // 2), "Q6_K": (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}


def describe_type(type_id: int) -> str:
    """The ggml name of ``type_id`` (``"type 99"`` for an id ggml does not name)."""
    return TYPE_NAMES.get(type_id, f"type {type_id}")


def block_geometry(type_name: str) -> tuple[int, int]:
    """``(weights a block, bytes a block)`` of a supported type."""
    return _GEOMETRY[type_name]


def native_format(type_name: str) -> str | None:
    """The forwardkit block format a GGUF type loads as (None: a dense type)."""
    if type_name in PACKED_TYPES:
        return type_name.lower()
    if type_name in REPACKED_TYPES:
        return REPACKED_TYPES[type_name]
    if type_name in DENSE_TYPES:
        return None
    raise ValueError(f"GGUF tensor type {type_name} is not supported; supported: "
                     f"{list(SUPPORTED_TYPES)}")


def dense_values(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` bytes (``uint8``) of an F32 / F16 / BF16 tensor as a float tensor of ``shape``."""
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
    return raw.reshape(-1).view(dtype).reshape(shape)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` bytes as ``[n, 1]`` float32 values of the fp16 they hold."""
    return raw.contiguous().view(torch.float16).float()


def _q4_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[n, 144]`` Q4_K super-blocks as ``(scale [n, 8], offset [n, 8], q [n, 8, 32])``:
    sub-block ``s`` holds ``scale[s] * q[s] - offset[s]`` (float32, ggml's products)."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    lo, hi, mix = packed[:, 0], packed[:, 1], packed[:, 2]
    # 6-bit scales and mins: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7
    # take 4 bits from bytes 8-11 and their top 2 bits from the top of bytes 0-3 / 4-7
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)
    # each run of 32 bytes holds two sub-blocks: the low nibbles, then the high ones
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    return d * sc.float(), dmin * mn.float(), q


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, 144]`` Q4_K super-blocks as ``[n, 256]`` float32 (ggml's values, bit for bit)."""
    scale, offset, q = _q4_k_parts(blocks)
    return (scale.unsqueeze(-1) * q.float() - offset.unsqueeze(-1)).reshape(-1, QK_K)


def _q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, 210]`` Q6_K super-blocks as ``(scale [n, 16], q - 32 [n, 16, 16])``."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks[:, 208:210])
    # two halves of 128 weights; in each, 64 bytes of low 4 bits (low nibbles: weights 0-63,
    # high nibbles: 64-127) and 32 bytes of high 2 bits (four 2-bit fields: 32 weights each)
    low = torch.cat([ql.reshape(n, 2, 1, 64) & 0x0F, ql.reshape(n, 2, 1, 64) >> 4], dim=2)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh.reshape(n, 2, 1, 32) >> shifts) & 0x03
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    return d * scales, q.reshape(n, 16, 16).float()


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, 210]`` Q6_K super-blocks as ``[n, 256]`` float32 (ggml's values, bit for bit)."""
    scale, q = _q6_k_parts(blocks)
    return (scale.unsqueeze(-1) * q).reshape(-1, QK_K)


def _fp16_checked(values: torch.Tensor, what: str) -> torch.Tensor:
    half = values.to(torch.float16)
    if not torch.isfinite(half).all() and torch.isfinite(values).all():
        raise ValueError(f"{what}: a sub-block scale exceeds the fp16 range and cannot be "
                         "repacked")
    return half


def repack_q4_k(raw: torch.Tensor, rows: int, name: str = "tensor") -> torch.Tensor:
    """A Q4_K tensor's bytes (``[rows, k / 256 * 144]``) as a ``q4_1`` weight
    ``[rows, k / 32 * 20]``: per sub-block, scale ``fp16(d*sc)``, minimum ``fp16(-dmin*mn)``
    and the same 4-bit values (the only rounding: those two fp16 conversions)."""
    scale, offset, q = _q4_k_parts(raw.reshape(-1, 144))
    d = _fp16_checked(scale.reshape(-1, 1), name).view(torch.uint8).reshape(-1, 2)
    m = _fp16_checked(-offset.reshape(-1, 1), name).view(torch.uint8).reshape(-1, 2)
    q = q.reshape(-1, BLOCK)
    nibbles = q[:, : BLOCK // 2] | (q[:, BLOCK // 2:] << 4)
    return torch.cat([d, m, nibbles], dim=1).reshape(rows, -1)


def repack_q6_k(raw: torch.Tensor, rows: int, name: str = "tensor") -> torch.Tensor:
    """A Q6_K tensor's bytes (``[rows, k / 256 * 210]``) as a ``q8_0`` weight
    ``[rows, k / 32 * 34]``: its float32 values requantized by ggml's q8_0 reference rounding."""
    values = dequantize_q6_k(raw.reshape(-1, 210)).reshape(rows, -1)
    return quantize(values, "q8_0", name)


def packed_values(raw: torch.Tensor, type_name: str, rows: int, name: str = "tensor") -> torch.Tensor:
    """A quantized tensor's bytes as the packed weight of its :func:`native_format`
    (``[rows, k / 32 * block_bytes]``)."""
    if type_name in PACKED_TYPES:
        return raw.reshape(rows, -1)
    if type_name == "Q4_K":
        return repack_q4_k(raw, rows, name)
    if type_name == "Q6_K":
        return repack_q6_k(raw, rows, name)
    raise ValueError(f"{name}: GGUF type {type_name} is not a quantized type forwardkit keeps "
                     f"packed; supported: {list(PACKED_TYPES) + list(REPACKED_TYPES)}")
