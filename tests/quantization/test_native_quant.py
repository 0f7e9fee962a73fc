"""The native quantized linear (``kernels/cpu/csrc/quant_linear.c``): every build this CPU runs,
every format, the few-row kernel (both strategies) and the tiled one, against
dequantize-then-matmul in float64, for 1-64 rows and odd shapes (row counts and output sizes
that leave short tiles); builds the CPU lacks are compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forwardkit.kernels.cpu import native_quant
from forwardkit.quantization import ops
from forwardkit.quantization.formats import dequantize, quantize

ISAS = ["amx", "avx512_vnni", "avx512", "avx2", "generic"]
FORMATS = ["q8_0", "q4_0", "q4_1"]
SHAPES = [(1, 32), (3, 96), (13, 64), (33, 2080), (257, 160)]  # (out, in)


def _expected(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fmt: str,
              strategy: str) -> torch.Tensor:
    """float64 dequantize-then-matmul; for ``int8`` the activations are first rounded as the
    kernel rounds them, so both comparisons are tight."""
    xs = x.float().double()
    if strategy == "int8":
        xs = _int8_activations(x.float()).double()
    return F.linear(xs, dequantize(packed, fmt).double(),
                    None if bias is None else bias.double())


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 strategy sees it: per block of 32, d = max|x| / 127 (float32, kept in
    float32, not rounded to fp16), q = roundf(x * (1 / d)); values q * d in float64."""
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))
    v = blocks * inv
    a = v.abs()
    q = torch.sign(v) * (torch.floor(a) + torch.floor(2 * (a - torch.floor(a))))
    return (q.double() * d.double()).reshape(x.shape)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = float(want.abs().max()) + 1e-6
    err = float((got.double() - want).abs().max())
    assert err <= rtol * scale * 10, f"max error {err:.3g} against outputs up to {scale:.3g}"


@pytest.fixture(params=ISAS)
def isa(request) -> str:
    if not native_quant.isa_supported(request.param):
        pytest.skip(f"the CPU lacks the instructions of the {request.param} build")
    native_quant.cache_clear()
    assert native_quant._function(request.param) is not None, "build failed or its self-check failed"
    return request.param


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("strategy", ["float", "int8"])
def test_few_rows_against_dequantized_matmul(isa, fmt, strategy):
    gen = torch.Generator().manual_seed(11)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        w[0, :32] = 0.0  # an all-zero block
        packed = quantize(w, fmt)
        bias = torch.randn(n, generator=gen) if n % 2 else None
        for rows in range(1, native_quant.MAX_ROWS + 1):
            x = torch.randn(rows, k, generator=gen)
            got = native_quant.quant_linear_rows(x, packed, bias, fmt, isa=isa, strategy=strategy)
            assert got is not None and got.shape == (rows, n)
            _close(got, _expected(x, packed, bias, fmt, strategy))


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_for_1_to_64_rows_and_odd_shapes(isa, fmt):
    """The tiled kernel (prompts) at every row count 1-64 (17, 33, 63: short activation tiles)
    and output sizes that are no multiple of the weight tile, against float64
    dequantize-then-matmul on the int8-rounded activations."""
    gen = torch.Generator().manual_seed(14)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen)
        w[-1, -32:] = 0.0  # an all-zero block
        packed = quantize(w, fmt)
        bias = torch.randn(n, generator=gen) if n % 2 else None
        x = torch.randn(64, k, generator=gen)
        x[1, :32] = 0.0  # an all-zero activation block
        for rows in range(1, 65):
            got = native_quant.quant_linear_rows(x[:rows], packed, bias, fmt, isa=isa, path="tiles")
            assert got is not None and got.shape == (rows, n)
            _close(got, _expected(x[:rows], packed, bias, fmt, "int8"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_over_several_chunks_of_rows(isa, fmt):
    """A long input dim (8192) makes the tiled kernel take the rows in chunks (32 rows: 256 KiB
    of int8 activations); 75 rows end in a short chunk and a short tile."""
    gen = torch.Generator().manual_seed(16)
    w = torch.randn(9, 8192, generator=gen)
    x = torch.randn(75, 8192, generator=gen)
    packed = quantize(w, fmt)
    got = native_quant.quant_linear_rows(x, packed, None, fmt, isa=isa, path="tiles")
    assert got is not None
    _close(got, _expected(x, packed, None, fmt, "int8"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiles_with_large_magnitudes(isa, fmt):
    """Activations and weights of very different scales per block (q8_0's unsigned-operand
    offset and q4_0's -8 are exact integer start values, so no cancellation shows)."""
    gen = torch.Generator().manual_seed(15)
    w = torch.randn(37, 256, generator=gen) * torch.logspace(-3, 3, 8).repeat_interleave(32)
    x = torch.randn(29, 256, generator=gen) * torch.logspace(3, -3, 8).repeat_interleave(32)
    packed = quantize(w, fmt)
    got = native_quant.quant_linear_rows(x, packed, None, fmt, isa=isa, path="tiles")
    assert got is not None
    _close(got, _expected(x, packed, None, fmt, "int8"))


@pytest.mark.parametrize("path,strategy", [("few", "int8"), ("few", "float"), ("tiles", "int8")])
def test_q8_0_quants_of_minus_128(isa, path, strategy):
    """A q8_0 block may hold -128 (ggml's quantizer stops at -127, a file need not): each
    kernel takes it as -128, not as +128 or 0. The int8 products move the weight's sign onto
    the activation (whose quants stop at -127) and take |q_w| unsigned, as VPABSB gives 128;
    negating the weight instead wraps -128 back to -128 and flips those products."""
    gen = torch.Generator().manual_seed(17)
    n, k = 19, 96
    packed = quantize(torch.randn(n, k, generator=gen), "q8_0").view(n, k // 32, 34).clone()
    q = packed[:, :, 2:].view(torch.int8)
    q[::2, :, ::3] = -128  # every other row, every third quant
    packed = packed.view(n, -1)
    rows_list = range(1, native_quant.MAX_ROWS + 1) if path == "few" else (1, 2, 7, 16, 33)
    for rows in rows_list:
        x = torch.randn(rows, k, generator=gen)
        got = native_quant.quant_linear_rows(x, packed, None, "q8_0", isa=isa, path=path,
                                             strategy=strategy)
        assert got is not None
        _close(got, _expected(x, packed, None, "q8_0", strategy))


@pytest.mark.parametrize("fmt", FORMATS)
def test_op_for_1_to_64_rows_and_dtypes(fmt):
    """The registered op (few-row kernel below TILES_MIN_ROWS rows, tiles from there; both
    int8) against float64."""
    native_quant.cache_clear()
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(40, 96, generator=gen)
    packed = quantize(w, fmt)
    bias = torch.randn(40, generator=gen)
    native = native_quant.available()
    for rows in (1, 2, 5, 16, 17, 33, 64):
        x = torch.randn(2, rows, 96, generator=gen)  # leading dims kept
        got = torch.ops.forwardkit.quant_linear(x, packed, bias, fmt)
        assert got.shape == (2, rows, 40) and got.dtype == torch.float32
        want = _expected(x.reshape(-1, 96), packed, bias, fmt, "int8" if native else "float")
        _close(got.reshape(-1, 40), want)
        got16 = torch.ops.forwardkit.quant_linear(x.bfloat16(), packed, bias.bfloat16(), fmt)
        assert got16.dtype == torch.bfloat16
        torch.testing.assert_close(got16.float(), want.reshape(2, rows, 40).float(),
                                   rtol=0.05, atol=0.05 * float(want.abs().max()))


def test_declines_what_it_does_not_serve():
    packed = quantize(torch.randn(8, 64), "q4_0")
    assert native_quant.quant_linear_rows(torch.randn(17, 64), packed, None, "q4_0", path="few") is None
    assert native_quant.quant_linear_rows(torch.randn(2, 64), packed, None, "q4_1") is None  # wrong layout
    assert native_quant.quant_linear_rows(torch.randn(2, 64), packed, None, "q8_0") is None  # wrong layout
    assert native_quant.quant_linear_rows(torch.randn(2, 64), packed, None, "q5_0") is None
    assert native_quant.quant_linear_rows(torch.randn(2, 96), packed, None, "q4_0") is None  # wrong k
    with pytest.raises(ValueError, match="path must be"):
        native_quant.quant_linear_rows(torch.randn(17, 64), packed, None, "q4_0", path="wide")


def test_kernel_chosen_by_rows_and_strategy(monkeypatch):
    """int8: the few-row kernel below TILES_MIN_ROWS rows, the tiles from there; float (the
    dequantize-then-matmul products): the few-row kernel up to MAX_ROWS, then declined."""
    build = native_quant._selected()
    if build is None:
        pytest.skip("no native quantized build")  # never: the generic build runs everywhere
    used: list[str] = []

    def spy(name: str, fn):
        def call(*args):
            used.append(name)
            return fn(*args)
        return call

    monkeypatch.setattr(native_quant, "_selected", lambda: build._replace(
        few_rows=spy("few", build.few_rows), tiles=spy("tiles", build.tiles)))
    packed = quantize(torch.randn(8, 64), "q4_1")
    for rows in (1, native_quant.TILES_MIN_ROWS - 1, native_quant.TILES_MIN_ROWS, 16, 17):
        x = torch.randn(rows, 64)
        assert native_quant.quant_linear_rows(x, packed, None, "q4_1") is not None
        exact = native_quant.quant_linear_rows(x, packed, None, "q4_1", strategy="float")
        assert (exact is None) == (rows > native_quant.MAX_ROWS)
    assert used == ["few", "few", "few", "few", "tiles", "few", "tiles", "few", "tiles"]


def test_op_without_a_native_build_takes_the_reference_path(monkeypatch):
    monkeypatch.setattr(native_quant, "_selected", lambda: None)
    for fmt in FORMATS:
        packed = quantize(torch.randn(8, 64), fmt)
        x = torch.randn(17, 64)
        torch.testing.assert_close(ops.quant_linear(x, packed, None, fmt),
                                   ops.reference_linear(x, packed, None, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_tiles_equal_the_vnni_tiles_bit_for_bit(fmt):
    """The amx build runs tiles of AMX_MIN_ROWS rows and more on the tile unit with the integer
    sums and the finishing order of the avx512_vnni build's 512-bit tiles, so their outputs are
    equal bit for bit: row counts that are and are not whole tiles of 16 (padded), below and
    above the threshold, an output count with a short weight tile, an input long enough for
    several chunks of rows (8192: 128 rows a chunk), a zero block on each side. Fails if the tile
    unit's operand layout, q4_0's signed nibbles, the scales or the padding are wrong, and if
    the tile unit did not serve (the build reports the threshold it runs from)."""
    for isa in ("amx", "avx512_vnni"):
        if not native_quant.isa_supported(isa):
            pytest.skip(f"the CPU lacks the instructions of the {isa} build")
    native_quant.cache_clear()
    amx = native_quant._function("amx")
    assert amx is not None, "amx build failed, its self-check failed or the OS refused AMX"
    gen = torch.Generator().manual_seed(23)
    for n, k, row_counts in ((37, 160, (16, 23, 24, 31, 32, 47, 64, 75)), (18, 8192, (150,))):
        w = torch.randn(n, k, generator=gen)
        w[-1, -32:] = 0.0
        packed = quantize(w, fmt)
        bias = torch.randn(n, generator=gen)
        x = (torch.randn(max(row_counts), k, generator=gen) * 2).bfloat16()
        x[5, 32:64] = 0.0
        for rows in row_counts:
            got = native_quant.quant_linear_rows(x[:rows], packed, bias, fmt, isa="amx", path="tiles")
            want = native_quant.quant_linear_rows(x[:rows], packed, bias, fmt, isa="avx512_vnni",
                                                  path="tiles")
            assert got is not None and want is not None
            assert torch.equal(got, want), f"{rows} rows, {n} x {k}"
            _close(got, _expected(x[:rows], packed, bias, fmt, "int8"), rtol=1e-2)


@pytest.mark.parametrize("name", ISAS)
def test_every_build_compiles(tmp_path, name):
    """Each ISA build compiles here, also one this CPU cannot run (compile only)."""
    from forwardkit.kernels.cpu.native_build import NoCompiler

    try:
        path = native_quant.compile_only(tmp_path, name)
    except NoCompiler:
        pytest.fail("no C compiler")
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    for symbol in ("fk_quant_abi_version", "fk_quant_max_rows", "fk_quant_linear",
                   "fk_quant_linear_tiles", "fk_quant_dequantize", "fk_quant_amx"):
        assert symbol.encode() + b"\0" in data, (name, symbol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_dequantize_is_bit_exact(fmt):
    """The native dequantization (the op's path for products no kernel serves) equals the torch
    one bit for bit."""
    native_quant.cache_clear()
    gen = torch.Generator().manual_seed(13)
    for n, k in SHAPES:
        packed = quantize(torch.randn(n, k, generator=gen), fmt)
        got = native_quant.dequantize_rows(packed, fmt)
        assert got is not None
        assert torch.equal(got, dequantize(packed, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_in_and_out_equal_converting_around_the_float_call(isa, fmt):
    """bfloat16 activations go into the kernels as they are and the result comes out in
    bfloat16: bit for bit the float32 call on the widened activations, rounded to nearest even
    by torch (fails if the kernel truncates, or widens or rounds any other way); NaN stays NaN."""
    gen = torch.Generator().manual_seed(21)
    packed = quantize(torch.randn(37, 160, generator=gen), fmt)
    bias = torch.randn(37, generator=gen)
    for rows, path in ((1, "few"), (3, "few"), (5, "tiles"), (70, "tiles")):
        x = (torch.randn(rows, 160, generator=gen) * 3).bfloat16()
        got = native_quant.quant_linear_rows(x, packed, bias, fmt, isa=isa, path=path)
        want = native_quant.quant_linear_rows(x.float(), packed, bias, fmt, isa=isa, path=path)
        assert got is not None and want is not None and got.dtype == torch.bfloat16
        assert torch.equal(got, want.bfloat16()), f"{rows} rows, {path}"
    x = torch.randn(1, 160, generator=gen).bfloat16()
    x[0, 0] = float("nan")
    got = native_quant.quant_linear_rows(x, packed, None, fmt, isa=isa, path="few", strategy="float")
    assert got is not None and bool(got.isnan().all())
