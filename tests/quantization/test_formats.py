"""q8_0 / q4_0 / q4_1 packing: bytes and values equal the ``gguf`` package's (ggml's reference
quantizers and dequantization), including all-zero blocks, ties and negative extremes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forwardkit.config.model import QUANTIZATION_FORMATS
from forwardkit.quantization import formats

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
          "q4_1": GGMLQuantizationType.Q4_1}


def _odd_weight(seed: int, rows: int = 24, k: int = 256) -> torch.Tensor:
    """Random rows with hard blocks: all zero, one nonzero, negative extreme, positive and
    negative ties of the largest magnitude, constant, values at rounding halves, huge/tiny."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=gen) * 0.05
    w[0, :32] = 0.0
    w[1, :32] = 0.0
    w[1, 5] = -3.0
    w[2, :32] = torch.linspace(-1.0, 0.5, 32)  # negative extreme
    w[3, :32] = torch.linspace(-0.5, 1.0, 32)
    w[4, :32] = 0.25
    w[4, 7], w[4, 20] = -2.0, 2.0  # a tie of magnitudes: the first one's sign wins (q4_0)
    w[5, :32] = -0.75  # constant negative block
    w[6, :32] = torch.arange(32) - 15.5  # halves after scaling
    w[7, :32] = torch.arange(32) - 15.5  # d = 1 for q8_0: every product is a half
    w[7, 0] = 127.0
    w[8, :32] = 1e-30
    w[9, :32] = torch.randn(32, generator=gen) * 6e4
    w[10, 32:64] = -torch.rand(32, generator=gen)
    return w


def _gguf_bytes(w: torch.Tensor, name: str) -> np.ndarray:
    return gguf_quants.quantize(w.float().numpy(), _TYPES[name])


@pytest.mark.parametrize("name", QUANTIZATION_FORMATS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_bytes_equal_gguf(name, seed):
    w = _odd_weight(seed)
    ours = formats.quantize(w, name)
    theirs = _gguf_bytes(w, name)
    assert ours.shape == theirs.shape == formats.packed_shape(name, *w.shape)
    np.testing.assert_array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("name", QUANTIZATION_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes_quantize_as_their_float32_values(name, dtype):
    w = _odd_weight(3).clamp(-6e4, 6e4).to(dtype)
    np.testing.assert_array_equal(formats.quantize(w, name).numpy(), _gguf_bytes(w.float(), name))


@pytest.mark.parametrize("name", QUANTIZATION_FORMATS)
def test_dequantize_equals_gguf_bit_for_bit(name):
    w = _odd_weight(4)
    packed = formats.quantize(w, name)
    ours = formats.dequantize(packed, name)
    theirs = gguf_quants.dequantize(packed.numpy(), _TYPES[name])
    assert ours.dtype == torch.float32 and ours.shape == w.shape
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("name", QUANTIZATION_FORMATS)
def test_dequantize_of_random_bytes_equals_gguf(name):
    """Any block bytes (not only our own output) decode as ggml decodes them."""
    fmt = formats.get_format(name)
    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (6, 4 * fmt.block_bytes), generator=gen, dtype=torch.uint8)
    d = torch.tensor([0.5, -0.25, 3.0, 1e-3], dtype=torch.float16).view(torch.uint8)
    for block in range(4):  # finite scales (random bytes may be inf/nan halves)
        base = block * fmt.block_bytes
        packed[:, base:base + 2] = d.reshape(4, 2)[block]
        if name == "q4_1":
            packed[:, base + 2:base + 4] = d.reshape(4, 2)[(block + 1) % 4]
    ours = formats.dequantize(packed, name).numpy()
    theirs = gguf_quants.dequantize(packed.numpy(), _TYPES[name])
    np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_q4_0_nibble_order_and_values():
    """Byte j holds element j (low nibble) and j + 16 (high nibble); x = d * (q - 8)."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16], w[0, 1] = -8.0, 7.0, 1.0  # d = -8 / -8 = 1
    packed = formats.quantize(w, "q4_0")
    assert packed[0, :2].view(torch.float16).item() == 1.0
    assert packed[0, 2].item() == (0 | (15 << 4))  # q = 0 low, q = 15 high
    assert packed[0, 3].item() == (9 | (8 << 4))
    torch.testing.assert_close(formats.dequantize(packed, "q4_0"), w, rtol=0, atol=0)


def test_errors_name_the_tensor_and_format():
    with pytest.raises(ValueError, match=r"layers\.0\.w: input dim 40 .* multiple of 32"):
        formats.quantize(torch.zeros(2, 40), "q8_0", name="layers.0.w")
    with pytest.raises(ValueError, match=r"quantization must be one of \['q8_0', 'q4_0', 'q4_1'\], got 'q5'"):
        formats.get_format("q5")
    with pytest.raises(ValueError, match="not a packed q4_0 weight"):
        formats.dequantize(torch.zeros(2, 19, dtype=torch.uint8), "q4_0")
